"""The generated model (`GeneratedModel`: runs a `GraphSpec`, prints as source) and a case of it
with example inputs (`ModelCase`, `build_case`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kinds import _KINDS
from .specs import GraphSpec, OpSpec


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #
#: The names the generated code may use.
_CODE_GLOBALS: dict[str, Any] = {"torch": torch, "nn": nn, "F": F}


@functools.lru_cache(maxsize=4096)
def _compiled(op: OpSpec) -> Callable[..., Any]:
    """``op``'s line of forward code as a function of ``self`` and its operands."""
    kind = _KINDS[op.kind]
    names = [f"a{i}" for i in range(len(op.args))]
    namespace: dict[str, Any] = {}
    exec(f"def op(self, {', '.join(names)}):\n"
         f"    {kind.region}return {kind.expression(op, names)}\n", _CODE_GLOBALS, namespace)
    return namespace["op"]


class GeneratedModel(nn.Module):
    """An ``nn.Module`` whose forward runs the ops of a :class:`GraphSpec`.

    ``GeneratedModel(spec)`` returns an instance of a subclass
    ``GeneratedModel<n>`` whose ``forward(self, x0, ..., x<n-1>)`` has one
    named argument per model input (so ``torch.fx`` creates one placeholder
    per input); its body loops over ``spec.ops`` in Python, running each op's
    line of code (the one :meth:`source` prints), a loop
    ``torch.fx.symbolic_trace`` unrolls.  Submodules, parameters and buffers
    are plain attributes (``linear0``, ``w3``, ``buf5``, ...) so the
    ``state_dict`` keys match the code printed by :meth:`source`.
    """

    spec: GraphSpec

    def __new__(cls, *args: Any, **kwargs: Any) -> GeneratedModel:
        if cls is GeneratedModel:
            spec = args[0] if args else kwargs["spec"]
            cls = _arity_class(len(spec.input_features))
        return super().__new__(cls)

    def __init__(self, spec: GraphSpec) -> None:
        super().__init__()
        self.spec = spec
        for op in spec.ops:
            kind = _KINDS[op.kind]
            if kind.init is not None:
                value = eval(kind.init(op.params), _CODE_GLOBALS)
                if kind.buffer:
                    self.register_buffer(op.attr, value)
                else:
                    setattr(self, op.attr, value)

    def forward(self, *inputs: torch.Tensor) -> Any:  # overridden per arity
        return self._run(list(inputs))

    def _run(self, inputs: list[Any]) -> Any:
        spec = self.spec
        if len(inputs) != spec.n_inputs:
            raise TypeError(f"expected {spec.n_inputs} inputs, got {len(inputs)}")
        values = list(inputs)
        for op in spec.ops:
            result = _compiled(op)(self, *(values[i] for i in op.args))
            if len(op.outs) == 1:
                values.append(result)
            else:
                # Index explicitly: fx proxies cannot be iterated.
                values.extend(result[j] for j in range(len(op.outs)))
        outs = [values[i] for i in spec.outputs]
        if spec.output_kind == "tensor":
            return outs[0]
        if spec.output_kind == "tuple":
            return tuple(outs)
        return dict(zip(spec.output_names(), outs))

    def source(self, class_name: str = "Model") -> str:
        """Python source of an equivalent ``nn.Module`` class (same state_dict keys)."""
        spec = self.spec
        feats = spec.value_features
        init_lines = [line for op in spec.ops if (line := _KINDS[op.kind].init_line(op))]
        fwd_lines = []
        for op in spec.ops:
            kind = _KINDS[op.kind]
            expr = kind.expression(op, [spec.value_name(i) for i in op.args])
            target = ", ".join(spec.value_name(i) for i in op.outs)
            shapes = ", ".join(f"(B, {feats[i]})" for i in op.outs)
            fwd_lines.append(f"{kind.region}{target} = {expr}  # {shapes}")
        outs = [spec.value_name(i) for i in spec.outputs]
        if spec.output_kind == "tensor":
            ret = outs[0]
        elif spec.output_kind == "tuple":
            ret = "(" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")"
        else:
            ret = "{" + ", ".join(f'"{k}": {v}' for k, v in zip(spec.output_names(), outs)) + "}"
        fwd_lines.append(f"return {ret}")
        args = ", ".join(["self"] + [spec.value_name(i) for i in range(spec.n_inputs)])
        in_shapes = ", ".join(f"{spec.value_name(i)}: (B, {f})"
                              for i, f in enumerate(spec.input_features))
        lines = [
            f"class {class_name}(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            *("        " + line for line in init_lines),
            "",
            f"    def forward({args}):  # {in_shapes}",
            *("        " + line for line in fwd_lines),
        ]
        return "\n".join(lines) + "\n"


_ARITY_CLASSES: dict[int, type[GeneratedModel]] = {}


def _arity_class(n: int) -> type[GeneratedModel]:
    """``GeneratedModel<n>``: a subclass whose forward takes ``n`` named inputs."""
    cls = _ARITY_CLASSES.get(n)
    if cls is None:
        if n < 1:
            raise ValueError("a generated model needs at least one input")
        name = f"GeneratedModel{n}"
        params = ", ".join(f"x{i}" for i in range(n))
        namespace: dict[str, Any] = {"__name__": __name__}
        exec(f"def forward(self, {params}):\n    return self._run([{params}])\n", namespace)
        forward = namespace["forward"]
        forward.__qualname__ = f"{name}.forward"
        cls = type(name, (GeneratedModel,), {
            "forward": forward, "__module__": __name__, "__qualname__": name,
            "__doc__": f"A :class:`GeneratedModel` with {n} input(s).",
        })
        _ARITY_CLASSES[n] = cls
        globals()[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    # Lets pickle find GeneratedModel<n> classes in a fresh process.
    suffix = name[len("GeneratedModel"):]
    if name.startswith("GeneratedModel") and suffix.isdigit():
        return _arity_class(int(suffix))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- #
# The case
# --------------------------------------------------------------------------- #
class ModelCase(NamedTuple):
    """A generated model and example inputs; unpacks as ``model, example_inputs``.

    ``repr(case)`` is :meth:`source`: pasteable Python that rebuilds the model
    (with the same weights) and example inputs.
    """

    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]

    @property
    def spec(self) -> GraphSpec:
        return self.model.spec

    def source(self) -> str:
        spec = self.spec
        batch = self.example_inputs[0].shape[0] if self.example_inputs else 1
        shapes = [f"torch.randn({batch}, {f})" for f in spec.input_features]
        inputs = "(" + ", ".join(shapes) + ("," if len(shapes) == 1 else "") + ")"
        return "\n".join([
            "import torch",
            "import torch.nn as nn",
            "import torch.nn.functional as F",
            "",
            "",
            self.model.source("Model"),
            "",
            f"torch.manual_seed({spec.seed})",
            "model = Model().eval()",
            f"example_inputs = {inputs}",
        ]) + "\n"

    def __repr__(self) -> str:
        return self.source()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # Hypothesis / IPython
        # Hypothesis prints "case=<this>," indented: bracket the source with
        # comment lines so the "case=" prefix and the trailing comma land in
        # comments and the lines in between paste as-is (after dedenting).
        p.text("# ModelCase source:")
        for line in self.source().rstrip("\n").splitlines():
            p.break_()
            p.text(line)
        p.break_()
        p.text("# end of ModelCase source")


def build_case(spec: GraphSpec, batch: int) -> ModelCase:
    """Instantiate ``spec`` exactly as the printed source does (same RNG stream)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = GeneratedModel(spec).eval()
        example_inputs = tuple(torch.randn(batch, f) for f in spec.input_features)
    return ModelCase(model, example_inputs)
