"""DeepSeek-V3 model: args, flavors, single-device model, MTP, HF state-dict adapter, counts."""

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.flavors import flavor_names, get_flavor
from models.deepseek_v3.model import DeepSeekV3Model, ModelOutput
from models.deepseek_v3.mtp import mtp_loss
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from models.deepseek_v3.stats import count_params, flops_per_token

__all__ = [
    "DeepSeekV3Model",
    "DeepSeekV3ModelArgs",
    "DeepSeekV3StateDictAdapter",
    "ModelOutput",
    "count_params",
    "flavor_names",
    "flops_per_token",
    "get_flavor",
    "mtp_loss",
]
