from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
PREFILL: Role
DECODE: Role

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "num_resumed", "prompt_logprobs", "grammar", "n", "choice", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    num_resumed: int
    prompt_logprobs: int
    grammar: str
    n: int
    choice: int
    min_p: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., num_resumed: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., n: _Optional[int] = ..., choice: _Optional[int] = ..., min_p: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "host_id", "protocol_version", "compat_hash", "model_name", "num_blocks", "block_size", "transfer_engine", "prefix_caching", "tensor_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENGINE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    grpc_address: str
    host_id: str
    protocol_version: int
    compat_hash: str
    model_name: str
    num_blocks: int
    block_size: int
    transfer_engine: str
    prefix_caching: bool
    tensor_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., grpc_address: _Optional[str] = ..., host_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., model_name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., transfer_engine: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class LoadStats(_message.Message):
    __slots__ = ("free_blocks", "total_blocks", "running", "waiting", "queued_prompt_tokens", "draining", "reserved_blocks", "unhealthy", "unhealthy_reason")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prompt_tokens: int
    draining: bool
    reserved_blocks: int
    unhealthy: bool
    unhealthy_reason: str
    def __init__(self, free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., reserved_blocks: _Optional[int] = ..., unhealthy: _Optional[bool] = ..., unhealthy_reason: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "reason", "heartbeat_interval_ms", "router_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    heartbeat_interval_ms: int
    router_id: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., router_id: _Optional[str] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("snapshot", "stored", "removed")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "kv_events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: LoadStats
    kv_events: KVEvents
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[LoadStats, _Mapping]] = ..., kv_events: _Optional[_Union[KVEvents, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "want_kv_snapshot")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    WANT_KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    known: bool
    want_kv_snapshot: bool
    def __init__(self, known: _Optional[bool] = ..., want_kv_snapshot: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("engine", "description")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    engine: str
    description: bytes
    def __init__(self, engine: _Optional[str] = ..., description: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("peer_worker_id", "peer_endpoint")
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    peer_worker_id: str
    peer_endpoint: Endpoint
    def __init__(self, peer_worker_id: _Optional[str] = ..., peer_endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class DisconnectRequest(_message.Message):
    __slots__ = ("peer_worker_id",)
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_worker_id: str
    def __init__(self, peer_worker_id: _Optional[str] = ...) -> None: ...

class DisconnectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("load", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOAD_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    load: LoadStats
    counters: _containers.ScalarMap[str, float]
    def __init__(self, load: _Optional[_Union[LoadStats, _Mapping]] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "writer_stopped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_STOPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    writer_stopped: bool
    def __init__(self, request_id: _Optional[str] = ..., writer_stopped: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "decode_worker_id", "block_ids", "slot", "generation", "write_deadline_s", "num_held_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WRITE_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_worker_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    generation: int
    write_deadline_s: float
    num_held_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., write_deadline_s: _Optional[float] = ..., num_held_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_tokens", "finish_reasons", "first_logprobs", "num_writes", "bytes_written", "prefill_seconds", "transfer_seconds", "prompt_logprobs", "bytes_skipped", "prefix_hit_tokens")
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_tokens: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    first_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    num_writes: int
    bytes_written: int
    prefill_seconds: float
    transfer_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    bytes_skipped: int
    prefix_hit_tokens: int
    def __init__(self, first_tokens: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., first_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., num_writes: _Optional[int] = ..., bytes_written: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., bytes_skipped: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmResponse(_message.Message):
    __slots__ = ("computed_tokens", "cached_tokens", "dropped")
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    computed_tokens: int
    cached_tokens: int
    dropped: bool
    def __init__(self, computed_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., dropped: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "prompt_token_ids", "writer_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WRITER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    writer_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., writer_worker_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "slot", "generation", "lease_s", "num_held_blocks")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    generation: int
    lease_s: float
    num_held_blocks: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., lease_s: _Optional[float] = ..., num_held_blocks: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_tokens", "num_writes", "sampling", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_writes: int
    sampling: SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_tokens: _Optional[_Iterable[int]] = ..., num_writes: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ColocatedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "logprobs", "prompt_logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...
