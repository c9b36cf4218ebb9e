"""Model classes in transformers' style. Importing `models` registers looprl's model types (`ouro`, `llada`) with
transformers' Auto classes, so a saved looped or masked-diffusion model reloads with `from_pretrained`."""

from models import diffusion as _diffusion  # noqa: F401  (AutoConfig / AutoModel / AutoModelForCausalLM registration)
from models import ouro as _ouro  # noqa: F401  (AutoConfig / AutoModelForCausalLM registration)
