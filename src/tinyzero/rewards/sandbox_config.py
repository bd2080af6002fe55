"""SandboxConfig: how model-written programs are run for code rewards (`reward.sandbox`).

veRL's names where veRL has them (its reward_model.sandbox_fusion.{url, max_concurrent,
memory_limit_mb}); the rest are the local sandbox's limits (tinyzero.runtime.sandbox).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["SandboxConfig"]


@dataclass
class SandboxConfig:
    url: str | None = None
    """A SandboxFusion server's run_code endpoint (e.g. http://localhost:8080/run_code): programs run
    there instead of in the local sandbox. None: the local sandbox."""

    max_concurrent: int = 4
    """Programs (or HTTP requests) in flight at once per scoring process."""

    memory_limit_mb: int = 1024
    """Address space of a program in MiB (a SandboxFusion server gets it as memory_limit_MB)."""

    timeout_s: float = 5.0
    """CPU seconds per test case (a call-based program gets timeout_s per call)."""

    wall_timeout_s: float | None = None
    """Wall-clock seconds per program run; None: 2 x the CPU time it may use + 1 s."""

    continuous: bool = True
    """True: the score is the fraction of test cases passed (veRL's continuous=True for codecontests /
    apps / codeforces / taco); False: 1.0 only when every test case passes, else 0."""

    max_tests: int | None = 10
    """continuous=True: score only the first max_tests test cases (veRL: 10); None: all of them."""

    max_output_bytes: int = 1 << 20
    """Bytes of stdout / stderr kept per run; a program that writes more is killed and fails the test."""

    file_size_mb: int = 16
    """Largest file a program may write, in MiB (also the size of its private tmpfs folder)."""

    max_open_files: int = 64
    """Open file descriptors per program."""

    max_processes: int = 16
    """Processes and threads per program (holds where the program gets its own uid or user namespace)."""

    isolation: Literal["auto", "namespaces", "process"] = "auto"
    """"namespaces": network, mount and PID namespaces (fails at start-up where the OS refuses them);
    "process": a limited process only; "auto": namespaces where available, else process (said once)."""

    uid_base: int = 61000
    """When the trainer runs as root, programs run under uids from here up (one per concurrent run,
    distinct per trainer process), never under the trainer's."""

    hide_paths: list[str] = field(default_factory=list)
    """More folders to hide from programs (the working folder, $HOME, /tmp, /root and /home always are)."""

    num_retries: int = 3
    """SandboxFusion: attempts per request on a connection error, a timeout, HTTP 5xx / 429 (then the
    sample fails under reward.on_error)."""

    request_timeout_s: float = 30.0
    """SandboxFusion: seconds to wait for one HTTP answer beyond the run's own time limit."""

    def __post_init__(self):
        if self.max_concurrent < 1:
            raise ValueError(f"reward.sandbox.max_concurrent must be >= 1, got {self.max_concurrent}")
        for name in ("memory_limit_mb", "max_output_bytes", "file_size_mb", "max_open_files", "max_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.sandbox.{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.sandbox.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.wall_timeout_s is not None and not self.wall_timeout_s > 0:
            raise ValueError(f"reward.sandbox.wall_timeout_s must be > 0 seconds or None, got {self.wall_timeout_s}")
        if self.max_tests is not None and self.max_tests < 1:
            raise ValueError(f"reward.sandbox.max_tests must be >= 1 or None (all), got {self.max_tests}")
        if self.isolation not in ("auto", "namespaces", "process"):
            raise ValueError(f"reward.sandbox.isolation must be auto, namespaces or process, got {self.isolation!r}")
        if self.num_retries < 1:
            raise ValueError(f"reward.sandbox.num_retries must be >= 1, got {self.num_retries}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.sandbox.url must be an http(s) URL such as http://host:8080/run_code, "
                             f"got {self.url!r}")
