"""Counts the weights alone, forgetting the gradients and AdamW's two moments (4 x the weights
in all)."""

TASK = "task8_4"
EXPECT = r"nothing fits \(each GPU holds 4 x the weights"


def choose_method(model_bytes, activation_bytes, gpu_memory, num_gpus, gpus_per_node, link,
                  moe=False):
    if link not in ("nvlink", "pcie") or min(model_bytes, gpu_memory, num_gpus) <= 0:
        raise ValueError("bad arguments")
    if num_gpus % gpus_per_node:
        raise ValueError("not whole nodes")
    if model_bytes + activation_bytes <= gpu_memory:
        return "one device" if num_gpus == 1 else "ddp"
    if num_gpus == 1:
        raise ValueError(f"needs {model_bytes + activation_bytes} bytes")
    if model_bytes / num_gpus + activation_bytes <= gpu_memory:
        return "fsdp"
    if model_bytes / num_gpus + activation_bytes / gpus_per_node <= gpu_memory:
        return "tp+fsdp" if link == "nvlink" else "pp+fsdp"
    raise ValueError(f"needs {model_bytes / num_gpus} bytes")
