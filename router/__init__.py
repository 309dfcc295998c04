"""The router: OpenAI HTTP API (`router.api`), request orchestration (`router.orchestrator`),
routing policy (`router.policy`), membership (`router.membership`) and the Registry service with
connection brokering (`router.registry`). Run it with ``python -m router``; it imports only `rpc`
and the engine's tokenizer."""
