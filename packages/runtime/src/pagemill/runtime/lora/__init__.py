"""Many LoRA adapters served at once over one base model (see the runtime README).

`LoRARequest` names an adapter (vLLM's class and fields); `manager.LoRAManager` holds them in
device slots with a CPU cache behind; `peft` reads and checks adapter folders; the batched
delta itself is `pagemill.kernels.add_lora`. Only the request is imported here: the front
end needs it without torch.
"""

from pagemill.runtime.lora.request import LoRARequest

__all__ = ["LoRARequest"]
