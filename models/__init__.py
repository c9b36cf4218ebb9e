"""Model classes in transformers' style. Importing `models` registers looprl's model types (`ouro`) with
transformers' Auto classes, so a saved looped model reloads with `AutoModelForCausalLM.from_pretrained`."""

from models import ouro as _ouro  # noqa: F401  (AutoConfig / AutoModelForCausalLM registration)
