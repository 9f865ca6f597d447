"""Tiny Hugging Face MoE models of every family the backend recognises, and a way to see Dynamo's graphs."""
import torch
import transformers

from moecompile.conversion.models import TINY_MOE

FAMILIES = tuple(TINY_MOE)
# MoE layers per tiny model (tiny-deepseek-v3's first layer is dense)
MOE_LAYERS = {name: 1 if name == "tiny-deepseek-v3" else 2 for name in FAMILIES}


def tiny_moe(name: str, seed: int = 0, one_layer: bool = False) -> torch.nn.Module:
    """A tiny model of `name` in eval mode, float32, with random routers (HF initialises some to zeros) and a
    random DeepSeek correction bias, so that routing, groups and biases all matter. one_layer: a single decoder
    layer, an MoE layer in every family (half the tracing, for checks that do not need a second layer)."""
    torch.manual_seed(seed)
    config, arch = TINY_MOE[name]()
    if one_layer:
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[-1:]
        if getattr(config, "first_k_dense_replace", None):
            config.first_k_dense_replace = 0
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("gate.weight", "router.weight", "router.bias")):
                p.normal_(0.0, 0.5)
            elif "experts." in pname and pname.endswith("_bias"):
                p.normal_(0.0, 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def token_ids(seed: int = 1, batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def dynamo_graphs(model, *args, **kwargs) -> list[tuple[torch.fx.GraphModule, list]]:
    """(graph, example inputs) for every graph Dynamo hands a backend for model(*args, **kwargs): one unless the
    model breaks the graph. The example inputs are real (parameters included), so gm(*inputs) runs the graph."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(*args, **kwargs)
    torch._dynamo.reset()
    return graphs


def moe_nodes(gm, name: str) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "moecompile" and n.target._opname == name]
