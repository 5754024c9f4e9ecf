"""Performance harness: every strategy against Lightning's DDP on an emulated cluster.

Each rank runs in its own Linux network namespace, joined to the others by veth links to a
bridge whose bandwidth is limited with ``tc ... tbf``; ranks are pinned one per core and an
optional straggler is slowed with a cgroup CPU quota (or an injected delay). See
``benchmarks/README.md`` and ``python -m benchmarks.run --help``.
"""
