"""`conveyor bench`: workloads, serving metrics under SLOs, policy comparison, reports and plots.

- `workload`: seeded requests (length distributions, a ShareGPT-like mix, JSONL traces) and
  their arrivals (request rate with Poisson or gamma gaps, fixed concurrency, sweeps);
- `metrics`: TTFT, TPOT, ITL, E2E, throughputs and goodput from per-request timestamps (pure);
- `client`: the load generator for any OpenAI-compatible streaming server, and /metrics;
- `offline`: conveyor configurations in-process and HF transformers baselines;
- `report`: the JSON result, its Markdown summary and PNG plots (occupancy timelines too);
- `commands`: the `conveyor bench` subcommands.

The package knows the engine only through its public API (`Engine`, `conveyor.replay`,
`conveyor.trace`) and servers only through HTTP. Importing it is light: torch, transformers,
httpx and matplotlib load when a run needs them.
"""
