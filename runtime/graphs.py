"""CUDA-graph capture, the one way moecompile records a function: warm-up runs on a side stream, then the record."""
import torch


def capture(fn, warmup: int = 1, generators=()):
    """(graph, output): fn() run `warmup` times on a side stream (autotuning and first allocations happen outside
    the graph), then recorded as a CUDA graph, which runs nothing; output is what the recorded call returned, the
    tensors each graph.replay() writes again. generators: CUDA generators (other than the default one) that fn
    draws from: each replay advances their state, so replays draw new numbers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output
