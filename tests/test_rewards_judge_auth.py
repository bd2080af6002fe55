"""reward.judge.api_key_env: a remote judge sends the key from the named environment variable as
`Authorization: Bearer <key>`, against a real local server that checks it (tests/judge_server.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.judge_server import JudgeServer
from tinyzero.rewards import RewardConfig, RewardManager
from tinyzero.rewards.judge import Judge
from tinyzero.rewards.judge_config import JudgeConfig


def test_the_api_key_named_by_api_key_env_is_sent_as_a_bearer_token(monkeypatch):
    key = "sk-judge-0123456789"
    s = JudgeServer(api_key=key)
    try:
        monkeypatch.setenv("TINYZERO_TEST_JUDGE_KEY", key)
        judge = Judge(JudgeConfig(enable=True, url=s.url, api_key_env="TINYZERO_TEST_JUDGE_KEY", concurrency=2))
        assert [r["score"] for r in judge.score(["q", "q"], ["4", "5"], [None, None])] == [1.0, 0.2]
        assert s.authorizations == [f"Bearer {key}"] * 3  # /v1/models, then the two requests
        # Without the key the server refuses (401 is not retried); a wrong key is refused too, and named nowhere.
        [r] = Judge(JudgeConfig(enable=True, url=s.url, model="judge-model")).score(["q"], ["4"], [None])
        assert r["judge"] == "failed" and "refused the request" in r["error"] and "HTTP 401" in r["error"]
        monkeypatch.setenv("TINYZERO_TEST_JUDGE_KEY", "sk-wrong-key")
        [r] = Judge(JudgeConfig(enable=True, url=s.url, model="judge-model", api_key_env="TINYZERO_TEST_JUDGE_KEY")
                    ).score(["q"], ["4"], [None])
        assert r["judge"] == "failed" and "HTTP 401" in r["error"] and "sk-wrong-key" not in r["error"]
        assert s.authorizations[-2:] == [None, "Bearer sk-wrong-key"]
    finally:
        s.close()


def test_an_api_key_env_without_a_key_stops_at_start_up(monkeypatch, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.delenv("TINYZERO_TEST_JUDGE_KEY", raising=False)
    cfg = RewardConfig(judge=JudgeConfig(enable=True, url="http://127.0.0.1:9", api_key_env="TINYZERO_TEST_JUDGE_KEY"))
    with pytest.raises(ValueError, match=r"^reward.judge.api_key_env=TINYZERO_TEST_JUDGE_KEY: the environment "
                                         r"variable TINYZERO_TEST_JUDGE_KEY is not set; export") as e:
        RewardManager(tokenizer, cfg)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("TINYZERO_TEST_JUDGE_KEY", " ")
    with pytest.raises(ValueError, match=r"variable TINYZERO_TEST_JUDGE_KEY is empty"):
        RewardManager(tokenizer, cfg)
    with pytest.raises(ValueError, match=r"must name an environment variable .*not hold the key"):
        JudgeConfig(enable=True, url="http://127.0.0.1:9", api_key_env="JUDGE_KEY=sk-123")
