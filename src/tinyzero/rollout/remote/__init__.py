"""The remote rollout engine ("remote"): generation on OpenAI-compatible HTTP servers (vLLM serve).

engine.py holds `RemoteRollout`; the HTTP plumbing it shares with remote judges is tinyzero.runtime.http.
"""

from tinyzero.rollout.remote.engine import RemoteRollout

__all__ = ["RemoteRollout"]
