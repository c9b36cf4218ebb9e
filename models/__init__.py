"""Model classes in transformers' style. Importing `models` registers looprl's model types (`ouro`, `llada`, `simplegpt`) with
transformers' Auto classes, so a saved looped, masked-diffusion or SimpleGPT model reloads with `from_pretrained`."""

from models import diffusion as _diffusion  # noqa: F401  (AutoConfig / AutoModel / AutoModelForCausalLM registration)
from models import ouro as _ouro  # noqa: F401  (AutoConfig / AutoModelForCausalLM registration)
from models import simplegpt as _simplegpt  # noqa: F401  (AutoConfig / AutoModel / AutoModelForCausalLM registration)
