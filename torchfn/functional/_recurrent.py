"""Recurrent layers (RNN, GRU, LSTM) written from elementary ops, safe under ``torch.func``.

Why not ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``: they keep a cached list of their weights
(``_flat_weights``) and run fused ``_VF`` kernels. :func:`make_functional` points parameter
slots at other tensors, ``vmap`` needs batching rules and MAML needs double backward; the fused
kernels break each of these with raw torch errors. The modules here compute the same numbers
from ``F.linear``, ``sigmoid``/``tanh``/``relu`` and a Python loop over time, read their
parameters at every call, and keep torch's parameter names, shapes, gate order
(LSTM ``i, f, g, o``; GRU ``r, z, n``) and call signature, so ``state_dict`` s are
interchangeable. The loop unrolls under ``torch.compile``: keep sequences short there.

:func:`recurrent_forward` is the pure function behind them; it can add zero "probes" to the
gate pre-activations and return each layer's inputs, which is what ghost per-sample gradient
rules need (the gradient of a recurrent weight is a sum over time of outer products, exactly
like a linear layer applied at every step).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from torchfn.functional._swap import restore_modules_, swap_modules_

__all__ = ["GRU", "LSTM", "RNN", "recurrent_forward", "replace_recurrent", "restore_recurrent"]

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}
Probes = Mapping[str, Mapping[str, Tensor]]


def _layer_keys(num_layers: int, bidirectional: bool) -> list[str]:
    """``["l0", "l0_reverse", "l1", ...]``: the suffixes of torch's parameter names."""
    dirs = ("", "_reverse") if bidirectional else ("",)
    return [f"l{k}{d}" for k in range(num_layers) for d in dirs]


class _RecurrentBase(nn.Module):
    """Shared constructor, parameters and forward of :class:`RNN`, :class:`GRU`, :class:`LSTM`."""

    _torch_class: type[nn.RNNBase]

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not (
            0 <= dropout <= 1
        ):
            raise ValueError(f"{name}(dropout=...): expected a number in [0, 1], got {dropout!r}")
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"{name}(hidden_size=...): expected an int > 0, got {hidden_size!r}")
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"{name}(num_layers=...): expected an int > 0, got {num_layers!r}")
        if proj_size < 0 or proj_size >= hidden_size:
            raise ValueError(f"{name}(proj_size=...): expected 0 (no projection) or "
                             f"0 < proj_size < hidden_size={hidden_size}, got {proj_size!r}")
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        factory = {"device": device, "dtype": dtype}
        gate = _GATES[mode] * hidden_size
        real = proj_size or hidden_size
        dirs = 2 if bidirectional else 1
        for key in _layer_keys(num_layers, bidirectional):
            layer = int(key[1:].split("_")[0])
            in_size = input_size if layer == 0 else real * dirs
            self.register_parameter(f"weight_ih_{key}",
                                    nn.Parameter(torch.empty(gate, in_size, **factory)))
            self.register_parameter(f"weight_hh_{key}",
                                    nn.Parameter(torch.empty(gate, real, **factory)))
            if bias:
                self.register_parameter(f"bias_ih_{key}",
                                        nn.Parameter(torch.empty(gate, **factory)))
                self.register_parameter(f"bias_hh_{key}",
                                        nn.Parameter(torch.empty(gate, **factory)))
            if proj_size:
                self.register_parameter(f"weight_hr_{key}",
                                        nn.Parameter(torch.empty(proj_size, hidden_size, **factory)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every parameter from ``U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))`` (torch's)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            if p.device.type != "meta":
                nn.init.uniform_(p, -bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.mode == "RNN_RELU":
            s += ", nonlinearity='relu'"
        for attr, default in (("bias", True), ("batch_first", False), ("dropout", 0.0),
                              ("bidirectional", False)):
            if getattr(self, attr) != default:
                s += f", {attr}={getattr(self, attr)}"
        return s

    def forward(self, input: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        out, hidden, _ = recurrent_forward(self, self._parameters, input, hx)  # type: ignore[arg-type]
        return out, hidden

    # -- conversion ---------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        cfg = {"input_size": self.input_size, "hidden_size": self.hidden_size,
               "num_layers": self.num_layers, "bias": self.bias,
               "batch_first": self.batch_first, "dropout": self.dropout,
               "bidirectional": self.bidirectional}
        if self.mode == "LSTM":
            cfg["proj_size"] = self.proj_size
        if self.mode.startswith("RNN"):
            cfg["nonlinearity"] = "tanh" if self.mode == "RNN_TANH" else "relu"
        return cfg

    def to_torch(self) -> nn.RNNBase:
        """Return torch's module of this kind holding this module's own Parameter objects.

        Example::

            >>> type(LSTM(3, 4).to_torch()).__name__
            'LSTM'
        """
        new = self._torch_class(**self._config(), device="meta")
        for name in list(new._parameters):
            setattr(new, name, self._parameters[name])  # RNNBase.__setattr__ keeps its cache
        new.train(self.training)
        return new


def _from_torch(cls: type[_RecurrentBase], m: nn.Module) -> Any:
    if type(m) is not cls._torch_class:
        raise TypeError(f"{cls.__name__}.from_torch(module): expected "
                        f"nn.{cls._torch_class.__name__}, got {type(m).__name__}")
    assert isinstance(m, nn.RNNBase)
    cfg = {"input_size": m.input_size, "hidden_size": m.hidden_size,
           "num_layers": m.num_layers, "bias": m.bias, "batch_first": m.batch_first,
           "dropout": m.dropout, "bidirectional": m.bidirectional}
    if cls is LSTM:
        cfg["proj_size"] = m.proj_size
    if cls is RNN:
        cfg["nonlinearity"] = "tanh" if m.mode == "RNN_TANH" else "relu"
    new = cls(**cfg, device="meta")
    for name in list(new._parameters):
        new._parameters[name] = m._parameters[name]
    new.train(m.training)
    return new


class RNN(_RecurrentBase):
    """Return ``(output, h_n)`` of an Elman RNN, like ``nn.RNN`` (transform-safe).

    Same arguments, parameter names/shapes and numbers as ``nn.RNN``:
    ``h_t = act(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)`` with ``act`` tanh or relu.
    ``input`` is ``(T, B, input_size)`` (``(B, T, input_size)`` with ``batch_first``) or
    unbatched ``(T, input_size)``; ``hx`` is ``(num_layers * D, B, hidden_size)`` (``D = 2``
    if bidirectional) or ``None`` (zeros). ``output`` is ``(T, B, D * hidden_size)``,
    ``h_n`` like ``hx``. ``PackedSequence`` input is refused: pad and mask instead.

    Example::

        >>> rnn = RNN(3, 5, num_layers=2, batch_first=True)
        >>> out, h = rnn(torch.randn(4, 7, 3))
        >>> out.shape, h.shape
        (torch.Size([4, 7, 5]), torch.Size([2, 4, 5]))
    """

    _torch_class = nn.RNN

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN(nonlinearity=...): expected 'tanh' or 'relu', got "
                             f"{nonlinearity!r}")
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size,
                         hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         device=device, dtype=dtype)
        self.nonlinearity = nonlinearity

    @classmethod
    def from_torch(cls, module: nn.Module) -> RNN:
        """Return an :class:`RNN` holding ``module``'s (an ``nn.RNN``) own Parameter objects.

        Example::

            >>> RNN.from_torch(nn.RNN(2, 3, nonlinearity="relu")).nonlinearity
            'relu'
        """
        return _from_torch(cls, module)


class GRU(_RecurrentBase):
    """Return ``(output, h_n)`` of a GRU, like ``nn.GRU`` (transform-safe).

    Gates in torch's order ``r, z, n``: ``r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)``,
    ``z`` likewise, ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``,
    ``h' = (1 - z) * n + z * h``. Shapes as in :class:`RNN` (``3 * hidden_size`` gate rows).

    Example::

        >>> out, h = GRU(3, 5, bidirectional=True)(torch.randn(7, 4, 3))
        >>> out.shape, h.shape
        (torch.Size([7, 4, 10]), torch.Size([2, 4, 5]))
    """

    _torch_class = nn.GRU

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device=device, dtype=dtype)

    @classmethod
    def from_torch(cls, module: nn.Module) -> GRU:
        """Return a :class:`GRU` holding ``module``'s (an ``nn.GRU``) own Parameter objects.

        Example::

            >>> GRU.from_torch(nn.GRU(2, 3)).hidden_size
            3
        """
        return _from_torch(cls, module)


class LSTM(_RecurrentBase):
    """Return ``(output, (h_n, c_n))`` of an LSTM, like ``nn.LSTM`` (transform-safe).

    Gates in torch's order ``i, f, g, o``; ``c' = f * c + i * g``, ``h' = o * tanh(c')``,
    projected by ``weight_hr_l{k}`` (``(proj_size, hidden_size)``) when ``proj_size > 0``.
    ``hx`` is ``(h_0, c_0)``: ``(num_layers * D, B, proj_size or hidden_size)`` and
    ``(num_layers * D, B, hidden_size)``, or ``None``. Other shapes as in :class:`RNN`.

    Example::

        >>> lstm = LSTM(3, 6, proj_size=2, batch_first=True)
        >>> out, (h, c) = lstm(torch.randn(4, 7, 3))
        >>> out.shape, h.shape, c.shape
        (torch.Size([4, 7, 2]), torch.Size([1, 4, 2]), torch.Size([1, 4, 6]))
        >>> list(lstm.state_dict()) == list(nn.LSTM(3, 6, proj_size=2).state_dict())
        True
    """

    _torch_class = nn.LSTM

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device=device, dtype=dtype)

    @classmethod
    def from_torch(cls, module: nn.Module) -> LSTM:
        """Return an :class:`LSTM` holding ``module``'s (an ``nn.LSTM``) own Parameter objects.

        Example::

            >>> LSTM.from_torch(nn.LSTM(2, 3, num_layers=2)).num_layers
            2
        """
        return _from_torch(cls, module)


_BY_TORCH: dict[type[nn.Module], type[_RecurrentBase]] = {
    nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM}


# -- the pure forward -------------------------------------------------------------------------


def _check_hidden(call: str, what: str, h: Any, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(h, Tensor):
        raise TypeError(f"{call}: expected {what} to be a Tensor of shape {shape}, got "
                        f"{type(h).__name__}")
    if tuple(h.shape) != shape:
        raise ValueError(f"{call}: expected {what} of shape {shape}, got {tuple(h.shape)}")
    return h


def _direction(mode: str, x: Tensor, h: Tensor, c: Tensor | None, w: dict[str, Tensor | None],
               reverse: bool, probe: Mapping[str, Tensor] | None, record: bool
               ) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """One layer, one direction over ``x`` ``(T, B, in)``; returns ``(out, h_T, c_T, rec)``."""
    seq_len = x.shape[0]
    gi = F.linear(x, w["ih"], w["b_ih"])  # every step's input projection at once
    if probe is not None:
        gi = gi + probe["ih"]
    outs: list[Tensor] = [x] * seq_len  # placeholders, all overwritten
    prev: list[Tensor] = [x] * seq_len
    cells: list[Tensor] = [x] * seq_len
    order = range(seq_len - 1, -1, -1) if reverse else range(seq_len)
    for t in order:
        prev[t] = h
        gh = F.linear(h, w["hh"], w["b_hh"])
        if probe is not None:
            gh = gh + probe["hh"][t]
        if mode == "LSTM":
            i, f, g, o = (gi[t] + gh).chunk(4, -1)
            assert c is not None
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if w["hr"] is not None:
                cells[t] = h
                h = F.linear(h, w["hr"])
                if probe is not None:
                    h = h + probe["hr"][t]
        elif mode == "GRU":
            i_r, i_z, i_n = gi[t].chunk(3, -1)
            h_r, h_z, h_n = gh.chunk(3, -1)
            r = torch.sigmoid(i_r + h_r)
            z = torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = (1 - z) * n + z * h
        elif mode == "RNN_TANH":
            h = torch.tanh(gi[t] + gh)
        else:
            h = torch.relu(gi[t] + gh)
        outs[t] = h
    rec: dict[str, Tensor] = {}
    if record:
        rec = {"x": x, "h_prev": torch.stack(prev)}
        if mode == "LSTM" and w["hr"] is not None:
            rec["hr_in"] = torch.stack(cells)
    return torch.stack(outs), h, c, rec


def recurrent_forward(
    module: nn.Module,
    params: Mapping[str, Tensor],
    input: Tensor,
    hx: Any = None,
    *,
    probes: Probes | None = None,
    record: bool = False,
) -> tuple[Tensor, Any, dict[str, dict[str, Tensor]]]:
    """Return ``(output, hidden, records)`` of ``module``'s recurrence run with ``params``.

    ``module`` is a torchfn :class:`RNN`, :class:`GRU` or :class:`LSTM` (only its settings
    are read); ``params`` maps torch's local parameter names (``weight_ih_l0``, ...) to
    tensors. ``output`` and ``hidden`` are what the module returns (``hidden`` is ``h_n``, or
    ``(h_n, c_n)`` for an LSTM). For per-sample gradient rules: ``probes`` (``{"l0": {"ih":
    (T, B, G * H), "hh": (T, B, G * H)[, "hr": (T, B, proj_size)]}, "l0_reverse": ...}``,
    time-major, ``G`` gates) are added to the input projection ``x W_ih^T + b_ih``, the hidden
    projection ``h W_hh^T + b_hh`` and the LSTM projection output of every step; with
    ``record=True``, ``records[key]`` holds that layer's time-major input ``"x"`` ``(T, B,
    in)``, the hidden state entering each step ``"h_prev"`` ``(T, B, H_out)`` and, with a
    projection, its input ``"hr_in"`` ``(T, B, hidden_size)``. Then the gradient of
    ``weight_ih`` is ``sum_t d(probe ih)_t^T x_t``, of ``weight_hh`` ``sum_t d(probe hh)_t^T
    h_prev_t``, of ``weight_hr`` ``sum_t d(probe hr)_t^T hr_in_t``, and the biases' are the
    sums over time of the probe gradients. Batched inputs only when probes or records are
    used.

    Example::

        >>> lstm = LSTM(3, 4)
        >>> params = {k: torch.zeros_like(v) for k, v in lstm.named_parameters()}
        >>> out, (h, c), _ = recurrent_forward(lstm, params, torch.randn(5, 2, 3))
        >>> bool(out.abs().max() == 0), h.shape
        (True, torch.Size([1, 2, 4]))
    """
    if not isinstance(module, _RecurrentBase):
        raise TypeError("recurrent_forward(module, ...): expected a torchfn.functional RNN, "
                        f"GRU or LSTM, got {type(module).__name__}")
    name = type(module).__name__
    call = f"{name}.forward(input, hx)"
    if isinstance(input, PackedSequence):
        raise TypeError(
            f"{call}: PackedSequence input is not supported by torchfn's transform-safe "
            "recurrent layers (packing makes the batch size change over time, which vmap, "
            "per-sample gradients and torch.compile cannot follow). Pad the sequences to one "
            "length (torch.nn.utils.rnn.pad_sequence), run the padded batch and mask the "
            "padded steps in the loss, or take each sequence's output at its last real step "
            "with output[arange(B), lengths - 1] (batch_first)"
        )
    if not isinstance(input, Tensor) or input.dim() not in (2, 3):
        seen = (f"shape {tuple(input.shape)}" if isinstance(input, Tensor)
                else type(input).__name__)
        raise ValueError(f"{call}: expected input of 3 dims ((T, B, input_size), or (B, T, "
                         "input_size) with batch_first) or 2 dims (unbatched (T, input_size)), "
                         f"got {seen}")
    if input.shape[-1] != module.input_size:
        raise ValueError(f"{call}: expected input.size(-1) == input_size={module.input_size}, "
                         f"got input of shape {tuple(input.shape)}")
    batched = input.dim() == 3
    if not batched and (probes is not None or record):
        raise ValueError(f"recurrent_forward({name}, ...): probes and records need a batched "
                         f"input, got shape {tuple(input.shape)}")
    x = input if batched else input.unsqueeze(1)
    if batched and module.batch_first:
        x = x.transpose(0, 1)
    seq_len, batch = x.shape[0], x.shape[1]
    if seq_len == 0:
        raise ValueError(f"{call}: expected at least one time step, got input of shape "
                         f"{tuple(input.shape)}")
    dirs = 2 if module.bidirectional else 1
    n_states = module.num_layers * dirs
    real = module.proj_size or module.hidden_size
    lstm = module.mode == "LSTM"
    h_shape = (n_states, batch, real) if batched else (n_states, real)
    c_shape = (n_states, batch, module.hidden_size) if batched else (
        n_states, module.hidden_size)
    if hx is None:
        h0 = x.new_zeros(n_states, batch, real)
        c0 = x.new_zeros(n_states, batch, module.hidden_size) if lstm else None
    else:
        if lstm:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{call}: expected hx to be a tuple (h_0, c_0) for an LSTM, got "
                                f"{type(hx).__name__}")
            h0 = _check_hidden(call, "h_0", hx[0], h_shape)
            c0 = _check_hidden(call, "c_0", hx[1], c_shape)
        else:
            h0, c0 = _check_hidden(call, "hx", hx, h_shape), None
        if not batched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None

    records: dict[str, dict[str, Tensor]] = {}
    h_n: list[Tensor] = []
    c_n: list[Tensor] = []
    layer_in = x
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            key = f"l{layer}{'_reverse' if d else ''}"
            w: dict[str, Tensor | None] = {
                "ih": params[f"weight_ih_{key}"], "hh": params[f"weight_hh_{key}"],
                "b_ih": params.get(f"bias_ih_{key}"), "b_hh": params.get(f"bias_hh_{key}"),
                "hr": params.get(f"weight_hr_{key}")}
            idx = layer * dirs + d
            out, h, c, rec = _direction(
                module.mode, layer_in, h0[idx], c0[idx] if c0 is not None else None, w,
                reverse=d == 1, probe=None if probes is None else probes[key], record=record)
            outs.append(out)
            h_n.append(h)
            if c is not None:
                c_n.append(c)
            if record:
                records[key] = rec
        layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if module.training and module.dropout > 0 and layer < module.num_layers - 1:
            layer_in = F.dropout(layer_in, module.dropout, training=True)
    output = layer_in
    h_out = torch.stack(h_n)
    c_out = torch.stack(c_n) if lstm else None
    if batched:
        if module.batch_first:
            output = output.transpose(0, 1)
    else:
        output, h_out = output.squeeze(1), h_out.squeeze(1)
        c_out = c_out.squeeze(1) if c_out is not None else None
    hidden = (h_out, c_out) if lstm else h_out
    return output, hidden, records


# -- swapping torch's modules -----------------------------------------------------------------


def _swap_recurrent_(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """Swap every exact ``nn.RNN/GRU/LSTM`` in ``module`` (in place) for torchfn's.

    Returns ``(root, swapped_paths)``: ``root`` is ``module`` or, if ``module`` itself is a
    recurrent layer, its replacement. Parameter objects are moved, not copied.
    """
    return swap_modules_(module, {t: twin.from_torch for t, twin in _BY_TORCH.items()})


def _restore_recurrent_(module: nn.Module, paths: list[str]) -> nn.Module:
    """Inverse of :func:`_swap_recurrent_` for the given module paths; returns the root."""
    return restore_modules_(module, paths, _RecurrentBase)


def replace_recurrent(module: nn.Module) -> nn.Module:
    """Return a deep copy of ``module`` with each ``nn.RNN/GRU/LSTM`` as torchfn's twin.

    Parameter values, ``requires_grad``, training flags and tied parameters carry over;
    ``state_dict`` keys are unchanged; ``module`` is not modified. Only the exact torch classes
    are swapped (a subclass may override ``forward``). Hooks on a swapped layer are dropped.
    :func:`make_functional` does this by default (``replace_recurrent=True``).

    Example::

        >>> net = nn.Sequential(nn.LSTM(4, 3))
        >>> type(replace_recurrent(net)[0]).__module__, type(net[0]).__name__
        ('torchfn.functional._recurrent', 'LSTM')
    """
    root, _ = _swap_recurrent_(copy.deepcopy(module))
    return root


def restore_recurrent(module: nn.Module) -> nn.Module:
    """Return a deep copy of ``module`` with torchfn's RNN/GRU/LSTM back as torch's classes.

    The inverse of :func:`replace_recurrent` (values, ``requires_grad``, ties and training
    flags carry over).

    Example::

        >>> type(restore_recurrent(LSTM(4, 3))).__module__
        'torch.nn.modules.rnn'
    """
    root = copy.deepcopy(module)
    paths = [n for n, m in root.named_modules(remove_duplicate=False)
             if isinstance(m, _RecurrentBase)]
    return _restore_recurrent_(root, paths)
