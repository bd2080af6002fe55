"""The docs stay true to the code: the config reference is what the generator writes from the
dataclasses, every relative link resolves, and every setting the topic pages name is a config key."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# pages whose settings are checked against the config (docs/verl.md names veRL's keys on purpose)
TOPIC_PAGES = ["getting-started.md", "your-own-task.md", "algorithms.md", "rollout.md", "parallelism.md",
               "async.md", "agents.md", "lora.md", "reliability.md", "performance.md", "EXTENDING.md",
               "distillation.md"]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `--a.b` flags and `a.b=value` overrides of sections of the root config
SECTIONS = ("data", "actor_rollout_ref", "critic", "reward_model", "reward", "custom_reward_function",
            "algorithm", "trainer", "dpo", "tuning")
FLAG = re.compile(r"(?:--|(?<![\w./-]))((?:{})(?:\.\w+)+)(?=[\s=`,)]|$)".format("|".join(SECTIONS)))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "scripts" / "gen_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_up_to_date():
    text = _generator().render()
    path = DOCS / "config.md"
    assert path.exists() and path.read_text() == text, (
        "docs/config.md differs from the config dataclasses: run `python scripts/gen_config_doc.py`")


def test_config_reference_lists_every_field_with_its_docstring():
    from tinyzero.config.parse import flag_names

    text = (DOCS / "config.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| .* \| (.*) \|$", text, re.M)}
    assert set(rows) == set(flag_names())
    assert all(doc.strip() for doc in rows.values()), [k for k, doc in rows.items() if not doc.strip()]
    # a Literal's choices are listed
    assert '`"stop" \\| "skip"`' in text.split("`reliability.nonfinite`")[1].split("\n")[0]


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_relative_links_resolve():
    bad = []
    for md in _markdown_files():
        for target in LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (md.parent / path).exists():
                bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert not bad, "links to missing files:\n" + "\n".join(bad)


def _known(key: str, leaves: frozenset, sections: frozenset) -> bool:
    from tinyzero.config.verl import _lookup

    if key in leaves or key in sections:
        return True
    parent = key.rsplit(".", 1)[0]
    while "." in parent:  # a key under a mapping field (custom_reward_function.reward_kwargs.weight)
        if parent in leaves:
            return True
        parent = parent.rsplit(".", 1)[0]
    found = _lookup(key)  # a veRL name that is renamed or converted onto a tinyzero field
    return found is not None and found[1].action in ("rename", "convert")


# a key written from inside its section (`rollout.sleep_level`, `fsdp_config.fsdp_size`)
SUBSECTIONS = ("rollout", "actor", "model", "ref", "optim", "fsdp_config", "multi_turn", "policy_loss",
               "filter_groups", "overlong_buffer", "kl_ctrl", "val_kwargs", "mixed_precision", "wrap_policy",
               "rollout_correction", "checkpoint", "sandbox", "judge")
SHORT_KEY = re.compile(r"`((?:{})(?:\.\w+)+)".format("|".join(SUBSECTIONS)))


def test_every_setting_the_pages_name_exists():
    from tinyzero.config.verl import _tinyzero_keys

    leaves, sections = _tinyzero_keys()
    every = leaves | sections
    bad = []
    for name in TOPIC_PAGES:
        page = DOCS / name
        assert page.exists(), f"docs/{name} is missing"
        for lineno, line in enumerate(page.read_text().splitlines(), 1):
            for key in FLAG.findall(line):
                if not _known(key, leaves, sections):
                    bad.append(f"docs/{name}:{lineno}: {key}")
            for key in SHORT_KEY.findall(line):
                if not any(k == key or k.endswith("." + key) for k in every):
                    bad.append(f"docs/{name}:{lineno}: {key}")
    assert not bad, "settings that are not config keys (see docs/config.md):\n" + "\n".join(bad)


def test_no_link_to_the_old_usage_page():
    hits = [str(p.relative_to(ROOT)) for d in ("README.md", "docs", "src", "tests", "bench", "scripts", "configs", "kernels")
            for p in ([ROOT / d] if d.endswith(".md") else (ROOT / d).rglob("*"))
            if p.is_file() and p.suffix in (".md", ".py", ".sh") and p.name != "test_docs.py"
            and "USAGE.md" in p.read_text(errors="ignore")]
    assert not hits, f"USAGE.md was split into docs/*.md; these still name it: {hits}"


# ------------------------------------------------------------------ the worked examples run as written
def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def _block(page: str, marker: str) -> str:
    found = [b for b in _python_blocks(page) if marker in b]
    assert len(found) == 1, f"docs/{page}: expected one python block with {marker!r}"
    return found[0]


def test_your_own_task_example_writes_valid_data_and_scores_it(tmp_path, monkeypatch):
    from tinyzero.data.schema import iter_parquet_rows, validate_rl_parquet
    from tinyzero.rewards.scoring import ScorerSpec, score_tasks

    monkeypatch.chdir(tmp_path)
    exec(compile(_block("your-own-task.md", "make_sort_data.py"), "make_sort_data.py", "exec"), {})
    assert validate_rl_parquet("data/sort/train.parquet") == 2048
    assert validate_rl_parquet("data/sort/test.parquet") == 128
    row = next(iter_parquet_rows("data/sort/test.parquet"))
    numbers = [int(x) for x in row["prompt"][0]["content"].split(": ")[1].split(".")[0].split()]
    assert row["reward_model"]["ground_truth"] == " ".join(map(str, sorted(numbers)))

    (tmp_path / "sort_reward.py").write_text(_block("your-own-task.md", "def compute_score"))
    truth = row["reward_model"]["ground_truth"]
    tasks = [("sort_numbers", f"<answer>{truth}</answer>", truth, {}),
             ("sort_numbers", "<answer>3 2 1</answer>", truth, {}),
             ("sort_numbers", truth, truth, {})]
    for kwargs, wrong in (({}, 0.1), ({"format_score": 0.0}, 0.0)):  # the reward_kwargs of the command
        spec = ScorerSpec(custom_fn=f"{tmp_path / 'sort_reward.py'}:compute_score", call="keyword",
                          reward_kwargs=kwargs)
        results = score_tasks(tasks, spec=spec)
        assert [r["score"] for r in results] == [1.0, wrong, 0.0]
        assert [r["extra"]["acc"] for r in results] == [1.0, 0.0, 0.0]


def test_extending_estimator_and_loss_examples_register_and_compute():
    import torch

    from tinyzero.algorithms import advantages, losses

    namespace = dict(vars(advantages))
    exec(_block("EXTENDING.md", "grpo_median"), namespace)
    try:
        assert advantages.get_adv_estimator_spec("grpo_median").needs_groups
        rewards = torch.zeros(6, 3)
        rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 3.0])
        mask = torch.tensor([[1, 1, 1]] * 5 + [[1, 1, 0]], dtype=torch.float32)
        index = ["a", "a", "a", "b", "b", "b"]
        adv, _ = advantages.get_adv_estimator_fn("grpo_median")(token_level_rewards=rewards, response_mask=mask,
                                                                index=index)
        expected = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 2.0])  # medians: 0 (group a), 1 (group b)
        assert torch.allclose(adv, expected[:, None] * mask)
    finally:
        advantages.ADV_ESTIMATORS.pop("grpo_median", None)

    namespace = dict(vars(losses))
    exec(_block("EXTENDING.md", "clipped_pg"), namespace)
    try:
        fn = losses.get_policy_loss_fn("clipped_pg")
        old = torch.tensor([[-1.0, -2.0]])
        new = torch.tensor([[-0.5, -2.0]], requires_grad=True)  # ratios e^0.5 (clipped at 1.2) and 1
        adv = torch.tensor([[1.0, 2.0]])
        mask = torch.ones(1, 2)
        config = type("ActorClip", (), {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2})()
        loss, clipfrac, kl, lower = fn(old, new, adv, mask, "token-mean", config)
        assert torch.isclose(loss, torch.tensor(-(1.2 * -0.5 + 2.0 * -2.0) / 2))
        assert clipfrac.item() == 0.5 and torch.isclose(kl, torch.tensor(-0.25)) and lower.item() == 0
        loss.backward()
        assert torch.allclose(new.grad, torch.tensor([[-0.6, -1.0]]))
    finally:
        losses.POLICY_LOSSES.pop("clipped_pg", None)


def test_extending_scorer_example_scores():
    namespace: dict = {}
    exec(_block("EXTENDING.md", "def score_details"), namespace)
    score = namespace["score_details"]
    assert score("x <answer>1 2 3</answer>", "1 2 3") == {"score": 1.0, "acc": 1.0, "formatted": True}
    assert score("<answer>3 2 1</answer>", "1 2 3")["score"] == 0.1
    assert score("1 2 3", "1 2 3")["score"] == 0.0


def test_extending_engine_example_matches_the_native_engine_greedy(tiny_model_dir):
    import torch
    from transformers import AutoTokenizer

    from tinyzero.protocol import DataProto
    from tinyzero.rollout import ENGINES, RolloutConfig, RolloutEngine, build_rollout

    namespace: dict = {}
    exec(_block("EXTENDING.md", "class HFGenerateRollout"), namespace)
    exec(_block("EXTENDING.md", '@register_engine("hf_generate")').replace(
        "from tinyzero.rollout.hf_generate import HFGenerateRollout\n", ""),
        {**namespace, "register_engine": __import__("tinyzero.rollout", fromlist=["x"]).register_engine})
    try:
        tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
        enc = tok(["What is 12 + 7?", "Count down from 10 to 1."], return_tensors="pt", padding=True)
        mask = enc["attention_mask"]
        batch = DataProto.from_dict(
            {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
            meta_info={"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
        outs = {}
        for name in ("hf_generate", "native"):
            engine = build_rollout(RolloutConfig(name=name, response_length=12, do_sample=False), tiny_model_dir,
                                   tok, device="cpu", load_weights=True)
            assert isinstance(engine, RolloutEngine)
            outs[name] = engine.generate_sequences(batch)
        for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
            assert torch.equal(outs["hf_generate"].batch[key], outs["native"].batch[key]), key
        assert torch.allclose(outs["hf_generate"].batch["rollout_log_probs"], outs["native"].batch["rollout_log_probs"],
                              atol=1e-4)
    finally:
        ENGINES.pop("hf_generate", None)


def test_readme_module_table_follows_the_layers():
    """Every package of tests/test_layering.py sits in the README's table under its layer, bottom up."""
    from tests.test_layering import LAYERS

    names = {1: "foundations", 3: "components", 4: "workers", 5: "driver and programs"}
    assert set(LAYERS.values()) == set(names), "a layer was added or renumbered: name it here and in README.md"
    rows = re.findall(r"^\| (foundations|components|workers|driver and programs) \| (.*?) \|",
                      (ROOT / "README.md").read_text(), re.M)
    seen = {}
    for layer, modules in rows:
        for package in re.findall(r"`tinyzero\.(\w+)", modules):
            seen[package] = layer
    assert {p: names[n] for p, n in LAYERS.items()} == seen
    order = [next(n for n, name in names.items() if name == layer) for layer, _ in rows]
    assert order == sorted(order), "the README's module table lists the layers bottom up"


def _train_commands(page: str) -> list[str]:
    """The arguments of every `train.py` command in the page's bash blocks (continuation lines joined)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (DOCS / page).read_text(), re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            if "train.py" in line and "..." not in line and not line.startswith("#"):
                out.append(line.split("train.py", 1)[1].strip())
    return out


def test_every_train_command_of_the_pages_parses(tmp_path):
    """Each documented command line builds a config (presets, flags, Hydra overrides), as train.py would;
    a `--config FILE` reads a saved default config instead."""
    import shlex

    from tinyzero.cli import parse_args
    from tinyzero.config import Config
    from tinyzero.config.parse import dump_yaml

    saved = tmp_path / "config.yaml"
    dump_yaml(Config(), str(saved))
    count, bad = 0, []
    for name in TOPIC_PAGES:
        for args in _train_commands(name):
            count += 1
            argv = shlex.split(args)
            if "--config" in argv:
                argv[argv.index("--config") + 1] = str(saved)
            try:
                parse_args(argv)
            except (Exception, SystemExit) as e:
                bad.append(f"docs/{name}: train.py {args}\n    {type(e).__name__}: {e}")
    assert count >= 20, count
    assert not bad, "\n".join(bad)
