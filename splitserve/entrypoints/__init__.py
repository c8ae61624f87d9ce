"""Entry points: `serve` and its launch, the API hub, topologies, `generate` and the offline LLM."""
