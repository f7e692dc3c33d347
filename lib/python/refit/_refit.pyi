# Type hints of refit's native module (lib/python/module.cpp). Use the refit package, whose
# Receiver and Streamer extend these classes.
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

__version__: str

class RefitStats:
    version: int
    tensors: int
    bytes: int
    batches: int
    seconds: float
    source_seconds: float
    pack_seconds: float
    wait_seconds: float
    direct: bool
    shared_bytes: int
    parts_bytes: int
    control_lane: bool
    subset: bool
    delta: bool
    base: int
    whole_after_refusal: bool
    dropped: List[DroppedReceiver]
    tensor_bytes: int
    elements: int
    changed: int
    base_bytes: int
    diff_seconds: float
    commit_seconds: float

class DroppedReceiver:
    endpoint: str
    code: int
    reason: str

class ReceiverStats:
    version: int
    tensors: int
    bytes: int
    batches: int
    seconds: float
    apply_seconds: float
    drain_seconds: float
    pause_seconds: float  # staged: Receiver.apply()'s copy of the stage into the weights

class View:
    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def whole(self) -> bool: ...
    @property
    def last(self) -> bool: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> Any: ...
    @property
    def tensor(self) -> Any: ...

class Receiver:
    def __init__(self, endpoint: Optional[str] = None, *, device: int = 0, idle_timeout: float = 60.0,
                 token: Optional[str] = None, curve: Any = None, engine: str = "automatic",
                 layout: str = "", streamers: int = 1, delta_threads: int = 0,
                 control_lane: bool = True, allow_insecure_tcp: bool = False,
                 stage: str = "none", stage_bytes: int = 0) -> None: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def device(self) -> int: ...
    def add_parameter(
        self,
        name: str,
        tensor: Any,
        source_slice: Optional[Tuple[int, int, int]] = None,
        *,
        scale: Any = None,
        quant: Optional[str] = None,
        dtype: Optional[str] = None,
        scale_2: Any = None,
        scale_layout: str = "row_major",
    ) -> None: ...
    def clear_parameters(self) -> None: ...
    def serve_one(self, timeout: float = 0.1) -> int: ...  # an Event value
    def _on_prepared(self, fn: Optional[Callable[[int], None]]) -> None: ...
    def _apply_prepared(self, stream: int = 0) -> Optional[int]: ...  # Receiver.apply()
    @property
    def prepared_version(self) -> Optional[int]: ...
    @property
    def stage(self) -> str: ...  # "none", "host" or "device"
    @property
    def committed_version(self) -> Optional[int]: ...
    @property
    def dirty(self) -> bool: ...
    @property
    def poisoned(self) -> bool: ...
    @property
    def last_stats(self) -> ReceiverStats: ...
    @property
    def last_error(self) -> Optional[str]: ...
    def close(self) -> None: ...

class Streamer:
    def __init__(self, endpoint: str, *, transport: str = "auto", receivers: Optional[List[str]] = None,
                 buffer_bytes: int = ..., buffers: int = 2, direct: bool = True, timeout: float = 30.0,
                 token: Optional[str] = None, device: int = 0, curve: Any = None, alignment: int = 256,
                 keep_whole: bool = True, engine: str = "automatic", layout: str = "", delta: bool = False,
                 delta_memory: str = "host", delta_max_bytes: int = ..., delta_threads: int = 0,
                 delta_batch_bytes: int = 0, group_rank: int = 0, group_size: int = 1, share_tensors: bool = True,
                 control_lane: bool = True, nccl_twin: bool = False, atomic: bool = False,
                 on_receiver_failure: str = "fail", min_receivers: int = 1, rejoin: bool = False,
                 receiver_groups: Optional[List[List[str]]] = None) -> None: ...
    def add_receiver(self, endpoint: str) -> None: ...
    def remove_receiver(self, endpoint: str) -> None: ...
    @property
    def receivers(self) -> List[str]: ...
    def refit(self, version: int, tensors: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]], *,
              stream: Any = None, subset: bool = False) -> RefitStats: ...
    def announce(self, hold: float = 1.0) -> int: ...
    @property
    def transport(self) -> Optional[str]: ...
    def close(self) -> None: ...

def nccl_library() -> Dict[str, Any]: ...
def use_nccl_library(path: str) -> None: ...
def _prefer_nccl_library(path: str) -> None: ...
