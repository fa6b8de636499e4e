"""Turning a step's scheduled work into padded arrays, and running the model on them.

Shapes are rounded up to a few buckets so that a handful of compiled programs serve every
step: decode-only steps by their number of sequences, other steps by their number of tokens
(their sequence arrays always have ``max_num_seqs`` rows; padding rows compute nothing), and
the rows whose logits are needed by their count. The model runs one call per stage
(embedding, each layer, picking the rows, head; see :mod:`engine.worker.stages`) rather than one
call for the whole model: the layers share one compiled program, which makes a warm-up of
every bucket take seconds instead of minutes, for a dispatch overhead of well under a
millisecond per layer. Decode steps of a few sequences (``ONE_PROGRAM_ROWS``), where that
difference shows most, run the whole model as one program.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import models
import pallas_paged
from engine.core import scheduled_rows
from engine.core.scheduler import ScheduledGroupWork
from engine.worker import sampling_rows, stages, tensor_parallel
from engine.worker.buckets import bucket, powers_of_two, token_sizes
from models import Metadata

log = logging.getLogger(__name__)


def _min_rows(params) -> int:
    """The fewest rows a program multiplies by the weights. XLA:CPU's bfloat16 matrix-vector
    product runs at a tenth of the speed of its two-row product (``benchmarks/throughput.py
    chat`` measures it), so 16-bit weights XLA multiplies get at least two rows; float32 and
    weights packed for the native product are fastest unpadded."""
    linears = [w for path, w in jax.tree_util.tree_leaves_with_path(params) if getattr(path[-1], "key", None) == "w"]
    head = [] if "lm_head" in params else [params["embed"]]  # a tied embedding is the head
    xla_products = [w for w in [*linears, *head] if not pallas_paged.is_packed(w)]
    return 2 if any(w.dtype.itemsize == 2 for w in xla_products) and jax.default_backend() == "cpu" else 1


# Decode steps of up to this many rows run the whole model as one program (the "decode" stage)
# instead of a program per stage: a single sequence decodes 10-13% faster (float32 and
# bfloat16), 4-8 rows 5-9%, and with the native products 32 rows 7% (bfloat16) to 14%
# (float32): a step of 32 sequences took 28.1 against 30.0 ms and 37.3 against 43.5 ms.
# Each such program takes about 2 s to compile, so on a CPU only the small buckets get one; a
# cold start of the default server took 24.2 s with them, against its 30 s target. On a GPU or
# TPU every decode step is one program: a program per stage costs a dispatch per layer (about
# 18 for a step of SmolLM2 on an H100, where the device needs a few milliseconds), and there
# compiling runs on many cores.
ONE_PROGRAM_ROWS = 32


def one_program_rows(platform: str) -> int | None:
    """The most rows a decode step runs as one program on ``platform`` (None: every step)."""
    return ONE_PROGRAM_ROWS if platform == "cpu" else None

# The runner picks logits rows in a program of their own (``StepInputs.logits_rows``), so the
# layers' metadata carries none and one layer program serves every number of rows.
_NO_ROWS = np.zeros(0, np.int32)


@flax.struct.dataclass
class StepInputs:
    """One step's device arrays. input_ids, positions: int32[T]; logits_rows: int32[L]
    (indices into the T tokens); ``num_logits`` of the L rows are real. ``pick`` is False
    when the logits rows are all T tokens in order (a decode step), so there is nothing to pick."""

    input_ids: jax.Array
    positions: jax.Array
    metadata: Metadata
    logits_rows: jax.Array
    num_logits: int = flax.struct.field(pytree_node=False)
    pick: bool = flax.struct.field(pytree_node=False, default=True)


@flax.struct.dataclass
class ModelOutput:
    """What the model gives for a step: float32 logits [L, vocab], and each row's arg-max
    (int32 [L]; valid when ``Metadata.argmax_rows`` is set). Decode steps run as one
    program (``ONE_PROGRAM_ROWS``) also give, else None, the inputs of the decode one position on
    (:meth:`ModelRunner.advance`'s, with this step's input ids), computed in that program so
    that a lookahead waits on nothing else."""

    logits: jax.Array
    argmax: jax.Array | None = None
    next_inputs: StepInputs | None = None


def _fill_tables(block_tables: np.ndarray, tables: Sequence[tuple[int, ...]]) -> None:
    """Write each of ``tables`` into its row of ``block_tables`` (int32 [rows, max_blocks],
    zeros), all rows in one assignment."""
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lengths.sum()))
    rows = np.repeat(np.arange(len(tables)), lengths)
    block_tables[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = flat


def _decode_columns(works: Sequence[ScheduledGroupWork]) -> tuple[Sequence[tuple[int, ...]], Sequence, Sequence]:
    """The block tables, tokens and positions of decodes (one token each), from the rows'
    columns when the works are those alone (``engine.core.scheduled_rows``)."""
    planned = scheduled_rows.rows_alone(works)
    if planned is not None:
        return _row_columns(planned)
    return ([work.block_table for work in works], [work.token_ids[0] for work in works],
            [work.start for work in works])


def _row_columns(planned: scheduled_rows.ScheduledRows) -> tuple[Sequence[tuple[int, ...]], Sequence, Sequence]:
    """The rows' decodes as :func:`_decode_columns` gives them: block tables, tokens, positions."""
    return planned.tables, planned.rows.last_tokens, planned.starts


def _fill_decodes(columns: tuple[Sequence[tuple[int, ...]], Sequence, Sequence], block_tables: np.ndarray,
                  input_ids: np.ndarray, positions: np.ndarray, context_lens: np.ndarray,
                  query_start_loc: np.ndarray) -> int:
    """Write decodes of a token each, given as ``columns`` (their block tables, tokens and
    positions: :func:`_decode_columns`), into the first rows and tokens of a step's arrays
    (:meth:`ModelRunner.prepare`'s); returns their number."""
    tables, tokens, starts = columns
    n = len(tables)
    _fill_tables(block_tables, tables)
    input_ids[:n], positions[:n] = tokens, starts
    context_lens[:n] = positions[:n] + 1
    query_start_loc[1:] = np.minimum(np.arange(1, len(query_start_loc)), n)
    return n


def _slots(block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The KV-cache slot of each position (int [T]) of sequence ``rows[i]``, through its row of
    ``block_tables`` (int32 [rows, max_blocks])."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size


def _abstract(tree):
    """``tree`` with every array (or ``jax.ShapeDtypeStruct``) as a ``jax.ShapeDtypeStruct`` of
    the same shape, dtype and sharding (those already abstract as they are): what lowering
    needs, and no device memory."""
    return jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct)
                        else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _moved_on(inputs: StepInputs, advanced) -> StepInputs:
    """``inputs`` with the positions, slots and context lengths ``advanced`` (``stages._advanced``'s)."""
    positions, slots, context_lens = advanced
    return inputs.replace(positions=positions,
                          metadata=inputs.metadata.replace(slot_mapping=slots, context_lens=context_lens))


class ModelRunner:
    """Runs the model for a scheduled step; owns the compiled programs and their buckets."""

    def __init__(self, config: models.ModelConfig, params, *, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, mesh=None):
        self.config = config
        self.params = params
        # What the embed and head stages read: everything but the layers. Passing the whole
        # tree would cost each of those calls a few milliseconds of argument handling.
        self.outer_params = {key: value for key, value in params.items() if key != "layers"}
        self.mesh = mesh
        self._inputs = tensor_parallel.replicated(mesh)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.decode_buckets = powers_of_two(_min_rows(params), max_num_seqs)
        # Not under a mesh, whose stages keep activations replicated between stages.
        largest = one_program_rows(jax.default_backend())
        self.one_program_buckets = () if mesh is not None else tuple(
            size for size in self.decode_buckets if largest is None or size <= largest)
        self._whole_model: dict[int, object] = {}  # decode rows -> that bucket's program
        # No step holds more tokens than its sequences can: with max_num_seqs 1 and a 1024-token
        # model, a 2048-token bucket could never run (and its warm-up had no rows to hold it).
        self.max_step_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
        self.token_buckets = token_sizes(16, self.max_step_tokens)
        # Rows of logits in steps with prompts: coarser than the decode buckets, since every
        # (tokens, rows) pair is a program to compile, and a few padded rows cost little next
        # to a prompt.
        self.logits_buckets = powers_of_two(_min_rows(params), max_num_seqs, factor=4)

    def prepare(self, works: Sequence[ScheduledGroupWork], logits_tokens: Sequence[int], *,
                argmax_only: bool = False) -> StepInputs:
        """Padded arrays for ``works``; ``logits_tokens`` are indices (into the concatenated
        tokens of ``works``) whose logits are wanted; ``argmax_only``: of those, only each one's
        arg-max (``Metadata.argmax_rows``)."""
        num_tokens = scheduled_rows.num_tokens(works)
        decode_only = num_tokens == len(works)
        if decode_only:
            num_rows = num_padded = bucket(self.decode_buckets, len(works))
        else:
            num_rows, num_padded = self.max_num_seqs, bucket(self.token_buckets, num_tokens)
        input_ids = np.zeros(num_padded, np.int32)
        positions = np.zeros(num_padded, np.int32)
        slot_mapping = np.full(num_padded, -1, np.int32)
        block_tables = np.zeros((num_rows, self.max_blocks), np.int32)
        context_lens = np.zeros(num_rows, np.int32)
        query_start_loc = np.zeros(num_rows + 1, np.int32)
        arrays = (block_tables, input_ids, positions, context_lens, query_start_loc)
        if decode_only:  # a token per work: whole columns at once
            _fill_decodes(_decode_columns(works), *arrays)
        else:  # the rows' decodes from their columns, then the others work by work
            planned, others = scheduled_rows.rows_of(works)
            cursor = 0 if planned is None else _fill_decodes(_row_columns(planned), *arrays)
            _fill_tables(block_tables[cursor:], [work.block_table for work in others])
            for row, work in enumerate(others, start=cursor):
                n = len(work.token_ids)
                span = slice(cursor, cursor + n)
                input_ids[span] = work.token_ids
                positions[span] = np.arange(work.start, work.start + n)
                context_lens[row] = work.context_len
                cursor += n
                query_start_loc[row + 1 :] = cursor
        real = slice(0, int(query_start_loc[-1]))
        rows = np.repeat(np.arange(len(works)), np.diff(query_start_loc[: len(works) + 1]))
        slot_mapping[real] = _slots(block_tables, rows, positions[real], self.block_size)
        pick = not (decode_only and list(logits_tokens) == list(range(len(works))))
        sizes = self.decode_buckets if not pick else (
            self.token_buckets if len(logits_tokens) > self.max_num_seqs else self.logits_buckets)
        logits_rows = np.zeros(min(bucket(sizes, max(len(logits_tokens), 1)), num_padded), np.int32)
        logits_rows[: len(logits_tokens)] = logits_tokens
        argmax_rows = np.int32(len(logits_tokens) if argmax_only else 0)
        metadata = Metadata(slot_mapping=slot_mapping, block_tables=block_tables, context_lens=context_lens,
                            query_start_loc=query_start_loc, logits_indices=_NO_ROWS, argmax_rows=argmax_rows,
                            decode_only=decode_only, block_size=self.block_size)
        inputs = StepInputs(input_ids, positions, metadata, logits_rows, len(logits_tokens), pick)
        return jax.device_put(inputs, self._inputs)

    def with_tables_of(self, next_inputs: StepInputs, works: Sequence[ScheduledGroupWork]) -> StepInputs:
        """``next_inputs``, the inputs of the decode after ``works`` (decodes), with their block
        tables and slots from ``works``: for a lookahead when the scheduler gave a sequence its
        next block (``SchedulerConfig.reserve_next_block``) after ``next_inputs`` was computed
        on the device from the tables before."""
        metadata, size, n = next_inputs.metadata, self.block_size, len(works)
        tables = np.zeros(metadata.block_tables.shape, np.int32)
        planned = scheduled_rows.rows_alone(works)
        if planned is not None:  # the rows' decodes: their columns
            _fill_tables(tables, planned.tables)
            positions = planned.starts + 1
        else:
            _fill_tables(tables, [work.block_table for work in works])
            positions = np.fromiter((work.start for work in works), np.int64, n) + 1
        slots = np.full(metadata.slot_mapping.shape, -1, np.int32)
        slots[:n] = _slots(tables, np.arange(n), positions, size)
        tables, slots = jax.device_put((tables, slots), self._inputs)
        return next_inputs.replace(metadata=metadata.replace(block_tables=tables, slot_mapping=slots))

    def advance(self, inputs: StepInputs) -> StepInputs:
        """What :meth:`prepare` makes of the decodes one position after ``inputs``' (see
        :class:`engine.async_scheduling.Lookahead`), computed on the device from ``inputs``: only
        when ``inputs`` is a decode step (not ``pick``) whose sequences' block tables all hold
        their next tokens' slots."""
        return _moved_on(inputs, stages.call("advance", inputs.positions, inputs.metadata, config=self.config,
                                               mesh=self.mesh))

    def run(self, inputs: StepInputs, kv_caches) -> tuple[ModelOutput, list]:
        """Run every stage. Returns (the model's output, new kv_caches); the first
        ``inputs.num_logits`` rows of its logits are the ones asked for (the rest is padding).

        The caches are donated: use the returned ones.
        """
        call = functools.partial(stages.call, config=self.config, mesh=self.mesh)
        if not inputs.pick and len(inputs.input_ids) in self.one_program_buckets:
            args = (self.params, inputs.input_ids, inputs.positions, inputs.metadata, kv_caches)
            # Only the rows change a decode program's shapes: looking it up by them skips the
            # general lookup's pass over the model's hundreds of arrays (0.5 ms a step).
            program = self._whole_model.get(len(inputs.input_ids))
            if program is None:
                program = self._whole_model[len(inputs.input_ids)] = stages.executable(
                    "decode", *args, config=self.config, mesh=self.mesh)
            logits, kv_caches, argmax, advanced = program(*args)
            return ModelOutput(logits, argmax, _moved_on(inputs, advanced)), kv_caches
        x, positional = call("embed", self.outer_params, inputs.input_ids, inputs.positions)
        layer = stages.executable("layer", self.params["layers"][0], x, positional, inputs.metadata,
                                    kv_caches[0], config=self.config, mesh=self.mesh)
        new_caches = []
        for layer_params, kv_cache in zip(self.params["layers"], kv_caches, strict=True):
            x, kv_cache = layer(layer_params, x, positional, inputs.metadata, kv_cache)
            new_caches.append(kv_cache)
        h = call("pick", x, inputs.logits_rows) if inputs.pick else x
        logits, argmax = call("head", self.outer_params, h, inputs.metadata.argmax_rows)
        return ModelOutput(logits, argmax), new_caches

    def run_steps(self, inputs: StepInputs, kv_caches, batch, steps: Sequence[int], max_steps: int):
        """A multi-step decode of the works ``inputs`` was prepared from (a decode step): row i
        for ``steps[i]`` steps, sampled with ``batch`` (a ``SamplingBatch`` of the inputs' rows).
        Returns (tokens int32 [rows, max_steps], -1 past each row's steps; the sampler's
        outputs stacked [max_steps, rows, ...]; the new kv_caches; the last step's tokens, int32
        [rows], a loop after this one's inputs if every row ran ``max_steps``). Nothing is
        waited for."""
        rows = len(inputs.input_ids)
        per_row = np.zeros(rows, np.int32)
        per_row[: len(steps)] = steps
        per_row, tokens = jax.device_put((per_row, np.full((rows, max_steps), -1, np.int32)), self._inputs)
        return stages.call("decode_steps", self.params, inputs.input_ids, inputs.positions, inputs.metadata,
                           kv_caches, batch, per_row, tokens, config=self.config, mesh=self.mesh)

    def warm_up(self, kv_caches, num_steps: int = 1) -> None:
        """Compile every bucket now, so no step ever waits for the compiler; with ``num_steps``
        > 1, also each decode bucket's loop of that many steps (:meth:`run_steps`) for greedy
        sampling without logit biases, penalties or log-probabilities (other sampling compiles
        its loops on first use)."""
        start = time.monotonic()
        shapes = self._step_shapes()
        calls = [call for shape in shapes for call in self._calls(shape, kv_caches)]
        if num_steps > 1:
            calls += [self._loop_call(rows, kv_caches, num_steps) for rows in self.decode_buckets]
        compiled = stages.compile_all(calls)
        log.info("compiled %d programs for %d step shapes in %.1f s", compiled, len(shapes),
                 time.monotonic() - start)

    def activation_bytes(self, kv_caches) -> int:
        """The most device memory a step's program needs besides the weights and the KV cache
        (its other arguments, results and scratch), over the largest decode and the largest
        prefill step: what XLA's buffer assignment reports when compiling them for
        ``kv_caches`` (per layer ``(k, v)``, arrays or ``jax.ShapeDtypeStruct``s; one block
        will do). Compiles those programs without keeping them."""
        decode, *_, prefill = self._step_shapes()
        kv_caches = _abstract(kv_caches)
        resident = {id(leaf) for leaf in jax.tree.leaves((self._abstract_params, kv_caches))}
        calls = [call for shape in (decode, prefill) for call in self._calls(shape, kv_caches)]
        return max(stages.activation_bytes(*call, resident=resident) for call in calls)

    @functools.cached_property
    def _abstract_params(self):
        """(outer params, one layer's params, all params) as ``jax.ShapeDtypeStruct``s."""
        return _abstract((self.outer_params, self.params["layers"][0], self.params))

    def _calls(self, shape: tuple[int, int, int], kv_caches) -> list[tuple]:
        """The ``(stage, config, mesh, args)`` programs a step of ``shape`` (see
        :meth:`_step_shapes`) runs, for :func:`stages.compile_all`, with abstract arguments."""
        kind, num_tokens, num_logits = shape
        params, layer_params, all_params = self._abstract_params
        kv_caches = _abstract(kv_caches)
        works = self._dummy_works(kind, num_tokens)
        inputs = _abstract(self.prepare(works, list(range(num_logits)) if kind == 1 else [0] * num_logits))
        if kind == 1 and num_tokens in self.one_program_buckets:
            return [("decode", self.config, self.mesh, (all_params, inputs.input_ids, inputs.positions,
                                                        inputs.metadata, kv_caches))]
        calls = []
        if kind == 1:  # a lookahead's inputs (``advance``)
            calls.append(("advance", self.config, self.mesh, (inputs.positions, inputs.metadata)))
        x, positional = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=inputs.input_ids.sharding),
            jax.eval_shape(models.stages(self.config).embed, params, inputs.input_ids, inputs.positions))
        h = jax.ShapeDtypeStruct((inputs.logits_rows.shape[0], self.config.hidden_size), jnp.float32,
                                 sharding=inputs.input_ids.sharding)
        calls += [("embed", self.config, self.mesh, (params, inputs.input_ids, inputs.positions)),
                  ("layer", self.config, self.mesh, (layer_params, x, positional, inputs.metadata, kv_caches[0])),
                  ("head", self.config, self.mesh, (params, h, inputs.metadata.argmax_rows))]
        if inputs.pick:
            calls.append(("pick", self.config, self.mesh, (x, inputs.logits_rows)))
        return calls

    def _loop_call(self, rows: int, kv_caches, num_steps: int) -> tuple:
        """The ``(stage, config, mesh, args)`` of a greedy loop of ``num_steps`` over ``rows`` rows."""
        inputs = _abstract(self.prepare(self._dummy_works(1, rows), list(range(rows)), argmax_only=True))
        batch = _abstract(jax.device_put(sampling_rows.batch_for([], 0, self.config.vocab_size, size=rows),
                                         self._inputs))
        per_row, tokens = (jax.ShapeDtypeStruct(shape, jnp.int32, sharding=inputs.input_ids.sharding)
                           for shape in ((rows,), (rows, num_steps)))
        return ("decode_steps", self.config, self.mesh, (self._abstract_params[2], inputs.input_ids,
                                                         inputs.positions, inputs.metadata, _abstract(kv_caches),
                                                         batch, per_row, tokens))

    def _step_shapes(self) -> list[tuple[int, int, int]]:
        """Every step shape as (kind, tokens, logits rows): kind 1 is decode-only, 2 has prompts."""
        shapes = [(1, size, size) for size in self.decode_buckets]
        return shapes + [(2, size, rows) for size in self.token_buckets
                         for rows in sorted({min(r, size) for r in self.logits_buckets})]

    def logits_sizes(self) -> list[int]:
        """The row counts of the logits of every step shape (the sampler's shapes)."""
        return sorted({rows for _, _, rows in self._step_shapes()})

    def _dummy_works(self, kind: int, num_tokens: int) -> list[ScheduledGroupWork]:
        """Work of the right shape (a decode of ``num_tokens`` sequences, or a prefill of
        ``num_tokens`` tokens split into sequences no longer than the model allows), all of it
        written into block 0, which nothing reads before overwriting. A prefill bucket larger
        than any step gets the largest step, which pads to the same bucket."""
        if kind == 1:
            return [ScheduledGroupWork("warm-up", (i,), (0,), 0, (0,), False, True) for i in range(num_tokens)]
        num_tokens = min(num_tokens, self.max_step_tokens)
        longest = self.max_blocks * self.block_size
        sizes = [min(longest, num_tokens - start) for start in range(0, num_tokens, longest)]
        return [ScheduledGroupWork("warm-up", (i,), (0,) * n, 0, (0,) * -(-n // self.block_size), True, True)
                for i, n in enumerate(sizes)]
