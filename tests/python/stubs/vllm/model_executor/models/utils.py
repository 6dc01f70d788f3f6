"""vllm.model_executor.models.utils: extract_layer_index (vllm's rule for one attention
module per layer: the one integer in a dotted layer name)."""


def extract_layer_index(layer_name: str, num_attn_module: int = 1) -> int:
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    assert len(ints) == 1, f"layer name {layer_name} should only contain one integer"
    return ints[0]
