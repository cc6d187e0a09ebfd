"""The api service: HTTP / SSE / WebSocket front door of mstar (DESIGN.md section 7).

It validates requests, hands them to the data worker over ZMQ, streams the workers' token
outputs back as text (incremental detokenization) and exposes /health, /ready, /metrics.
It never touches tensors or KV. Run it with `python -m services.api`.
"""
