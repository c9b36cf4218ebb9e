"""The methods: one folder each, holding the method's core, its stage, its task generator and its plug-ins
(environment, reward, decoding hook), with a README. Each folder's `BUILTINS` names the modules that register
its built-ins; `rl.registry` reads them, so a new method is a new folder."""
