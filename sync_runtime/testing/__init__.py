"""The test harness, shipped with the package like `kopf.testing`: seeded weights, the Ray fleet
and local rank pools, the Megatron-Core CPU harness, real vLLM deployments, fault injection and
the serving checker.

Used by the tests, the benchmarks, the examples and the demo; no production module imports it
(an import-linter contract in .importlinter enforces that).
"""
