"""XLA_FLAGS for the tests' `jaxrl-llm` subprocesses: one real CPU device (what a user's laptop
has: not tests/conftest.py's 8 fake ones) and LLVM's cheapest optimisation level, as in-process
(tests/conftest.py): a subprocess's tiny programs then compile ~1.5x faster end to end (a tiny
`jaxrl-llm online` run: 18 s against 28 s on 2 cores). Dots call the same GEMM libraries; only
compile time changes, so the commands behave as a user's do."""

ONE_DEVICE = "--xla_backend_optimization_level=0"
