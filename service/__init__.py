"""The Tinker-compatible training service: the HTTP API the `tinker` SDK drives, over
sessions whose training clients are LoRA adapters on one frozen base model.

Layers, each importing only the ones above it in this list:
    errors, types          plain data and the one error type (no torch, no HTTP)
    proto                  the SDK's protobuf messages, encoded/decoded by hand
    wire                   JSON/proto request bodies -> `types`, naming the bad field
    storage                checkpoint folders and tinker:// paths (never escape the root)
    backend                the narrow interface a model backend implements
    scheduler, futures     per-model ordering, fair queueing, device-seconds, results
    sessions               sessions, models, samplers, heartbeats, expiry
    app                    the FastAPI routes
    server                 uvicorn, API keys, SIGTERM drain
`tools/serve.py` is the command-line front end; docs/service.md has the details.
"""
