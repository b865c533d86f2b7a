"""tally.cuda.graph: torch.cuda.graph's context manager over tally.cuda.CUDAGraph.

    g = tally.cuda.CUDAGraph()
    step()                          # warm up first (algorithm searches, optimizer state)
    with tally.cuda.graph(g):
        loss = step()               # captured, not run
    for batch in batches:
        static_x.copy_(batch)       # the captured step reads static_x
        g.replay()                  # loss holds this replay's value
"""

from . import _C


class graph:
    """Capture the work of the `with` block into `cuda_graph` (on `device`'s stream, its
    allocations from `pool`: a new private pool when None, another graph's pool() to share).
    As torch.cuda.graph does, the device is synchronised and the cache emptied first. An
    exception inside the block drops the capture (the graph stays empty) and propagates."""

    def __init__(self, cuda_graph, pool=None, device=0):
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.device = device

    def __enter__(self):
        if _C.memory.cuda_available() and 0 <= self.device < _C.memory.device_count():
            _C.memory.synchronize(f"cuda:{self.device}")
            _C.memory.empty_cache(f"cuda:{self.device}")
        self.cuda_graph.capture_begin(self.pool, self.device)
        return self.cuda_graph

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.cuda_graph.reset()  # ends the open capture and drops it
            return False
        self.cuda_graph.capture_end()
        return False
