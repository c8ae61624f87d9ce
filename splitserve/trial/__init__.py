"""The trial: replay one workload against several arrangements at equal cores and count good requests.

A trial reads in the order a request lives:
    spec.py (+ section.py)  the YAML spec, validated before anything starts
    arrivals.py, traces.py  when each request arrives (generated, or replayed from a trace)
    workload.py             what it asks: real text cut to exact token counts, fixed answer lengths
    arrangements.py         the server under test: launched `splitserve serve`, any command, or a URL
    client.py               the load generator: sends on schedule, stamps every token
    metrics.py              TTFT, gaps, pauses, SLOs, goodput, failures by kind
    runner.py               one plan, replayed per arrangement (and per rate, for --sweep)
    verdict.py, report.py   results.json, the verdict paragraph, terminal table, HTML report
    cli.py, analyze.py      `splitserve trial` and `splitserve workload analyze`
"""
