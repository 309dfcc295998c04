"""Runtime shared by the prefill and decode workers: config, model + KV pool + transfer engine
set-up, registration with the router (heartbeats carrying load), the gRPC server lifecycle and
signal handling. Imports engine, kvtransfer and rpc; never prefill, decode or router."""
