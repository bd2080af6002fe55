"""A tool worker process: `python -m tinyzero.agent.tool_worker`, started by ToolPool (pool.py).

Reads (tool specs, memory limit in MiB, max characters) once from stdin, loads the tools, caps its
own address space (RLIMIT_AS: what it uses now plus the limit), answers None (or the load error),
then answers each (tool name, arguments) with ("ok", text), ("error", message) or ("memory", message)
(the memory limit was hit), as length-prefixed pickles on stdout (tinyzero.runtime.subprocess_pool.serve).
It imports neither torch nor the trainer: a tool that misbehaves harms only this process, which the
pool kills and replaces.
"""

from __future__ import annotations

import resource

from tinyzero.runtime.subprocess_pool import serve


def address_space_bytes() -> int:
    """This process's current virtual memory size (VmSize), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def limit_memory(memory_mb: int) -> None:
    """RLIMIT_AS = current size + memory_mb MiB, so an allocation past it raises MemoryError."""
    limit = address_space_bytes() + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to max_chars characters with a marker saying how much was dropped."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [truncated {len(text) - max_chars} characters]"


def run_call(tools: dict, name: str, args: dict, max_chars: int) -> tuple[str, str]:
    tool = tools.get(name)
    if tool is None:
        return "error", f"unknown tool {name!r}; available: {sorted(tools)}"
    try:
        out = tool.call(args)
        text = out if isinstance(out, str) else str(out)
        return "ok", truncate(text, max_chars)
    except MemoryError:  # "memory": an error the model reads, which the pool also says on the console
        return "memory", "the tool ran out of memory (rollout.multi_turn.tool_memory_mb)"
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
        return "error", truncate(f"{type(e).__name__}: {e}", max_chars)


def setup(settings: tuple[list[str], int, int]):
    """Load the tools and cap the memory; the function that answers one (tool name, arguments) call."""
    specs, memory_mb, max_chars = settings
    from tinyzero.agent.tools import load_tool

    tools = {}
    for spec in specs:
        tool = load_tool(spec)
        tools[tool.name] = tool
    limit_memory(memory_mb)
    return lambda call: run_call(tools, *call, max_chars)


def main() -> None:
    serve(setup)


if __name__ == "__main__":
    main()
