"""The trial: replay one workload against several arrangements at equal resources and find how
much load each one holds within the SLOs.

A trial reads in the order a request lives:
    spec.py (+ section.py, method.py)  the YAML spec, validated before anything starts
    arrivals.py, traces.py  when each request arrives (generated, or replayed from a trace)
    workload.py             what it asks: real text cut to exact token counts, fixed answer lengths
    resources.py            equal cores and KV memory: checked, split, pinned, read back
    arrangements.py         the server under test: launched `splitserve serve`, any command, or a URL
    client.py               the load generator: sends on schedule, stamps every token
    metrics.py              TTFT, gaps, pauses, SLOs, goodput, failures and recoveries
    capacity.py, budget.py  capacity within the SLOs (grow, then bisect), in a wall-clock budget
    tuning.py               the strongest colocated baseline, from a small grid
    runner.py               calibration, repeats in rotating order, probes, fixed-rate and sweep runs
    results.py, verdict.py  results.json, and the paragraph that answers the buyer's question
    report.py, dryrun.py    terminal table and HTML report; the plan without running
    cli.py, analyze.py      `splitserve trial` and `splitserve workload analyze`
"""
