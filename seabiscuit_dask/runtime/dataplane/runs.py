"""One request of one model on one worker (a *run*), and what it does there.

A run takes its blocks' inputs as they arrive (``deliver``), starts each block once it
has them all (on a compute thread, on the event loop when that is cheaper, or chained to a
decode loop's logits: ``chain``), sends its outputs on to the workers that read them and
keeps the caller's, feeds the next step of a decode loop that follows it (``advance``),
fails here and downstream (``fail``), is forgotten by its caller (``forget``) and tidied
away once done (``tidy``). What spans runs (the runs by id, the blocks that ran, the runs
that ended, the worker's counters) is its run manager's (``Keeper``, ``manager.DataPlane``);
what the worker does for it (run a block, send a message) its ``host.Host``'s.

A prompt prefilled in chunks is sent chunk after chunk without waiting, so one chunk runs on
a stage while the one before runs on the next; each chunk's blocks here are held until the
chunk before has cached what they read (``after``; never by blocking a compute thread), and
fail when that chunk ended first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...errors import (
    BadCheckpoint,
    BadInput,
    BadMessage,
    BlockFailed,
    BudgetTooSmall,
    ClusterTooSmall,
    LaneStopped,
    RunFailed,
    SeaBiscuitError,
    StaleRun,
)
from ...lower.blocks import BlockSpec
from ...lower.kvcache import CacheLost
from .chain import Chain
from .host import ComputeArgs, Host, Outcome
from .loops import EDITS, PICKED, ROWS, Loop, greedy
from .wire import Tensors

logger = logging.getLogger(__name__)

WAITING, RUNNING, DONE = "waiting", "running", "done"
RunKey = tuple[str, int]                 # (model, request)
Memory = OrderedDict[Any, Any]
# NOTE: failures a peer may name by class (data, read from a message), so the caller acts on what
# happened: those running the request again cannot cure, and a session's cache lost with a worker
# (the caller replays the session at once, on the plan it holds); a run a worker's sync retired
# (the caller sends it again on the current plan). Any other arrives as RunFailed, which the caller
# retries under a new id once a newer plan comes.
KINDS: dict[str, type[SeaBiscuitError]] = {c.__name__: c for c in (ClusterTooSmall, BudgetTooSmall, BadInput,
                                                                    BadCheckpoint, CacheLost, StaleRun)}
REMEMBERED = 4096      # NOTE: blocks run and runs ended, kept to refuse repeats and late messages
INLINE_S = 2e-4        # NOTE: blocks quicker than this run on the event loop, not a compute thread
ALONE_S = 0.1          # NOTE: the longest block that runs on the event loop as the worker's only work


class Keeper(Protocol):
    """What a run asks of the run manager that keeps it: what spans the runs of one worker."""

    host: Host
    token_delay: float                               # how long a decode step's caller hears later
    counters: dict[str, int]
    records: list[dict[str, Any]]                    # block runs to report
    last_s: dict[tuple[str, int], float]             # (model, block) -> its last run's seconds
    ran: Memory                                      # (model, request, block) of blocks run here
    # NOTE: by run, not in it: a run here may end between its blocks (all it had then ran) and
    # start again with the next, and the loop that follows it must still be found
    loops: dict[RunKey, Loop]                        # run -> the decode loop that follows it
    lane_rows: Memory                                # a lane's step -> the sessions it runs
    picked: Memory                                   # a lane's step -> (its logits tile, its rows' picks)
    ended: Memory                                    # failed or forgotten runs -> their error
    done: Memory                                     # runs that finished here

    def holds(self, key: RunKey) -> bool:
        """Whether a run of ``key`` is held here now."""

    def get(self, model: str, version: int, request: int) -> Run | None:
        """The run held here, made if new; None for a run that ended (``StaleRun`` for an old plan)."""

    def drop(self, run: Run, error: BaseException | None) -> None:
        """``run`` failed (``error``) or finished: it is held no more, and is remembered so."""

    def hold(self, run: Run, ticket: str) -> None:
        """``run`` has blocks held behind the run it follows (``wake`` starts them)."""

    def wake(self, model: str) -> None:
        """Start the held blocks of ``model`` whose predecessors have now cached what they read (a
        block ran here)."""

    def alone(self, run: Run, br: BlockRun) -> bool:
        """Whether ``br`` is the only block that waits or runs here."""

    def tell(self, coro: Any) -> asyncio.Future[Any]:
        """Send a message, held until sent (a run forgotten meanwhile does not cancel it)."""

    async def pass_on(self, model: str, version: int, request: int, block: int, ticket: str, reason: str,
                      kind: str) -> None:
        """Tell the blocks downstream of ``block`` of a run that ended here that it failed."""


def remember(memory: Memory, key: Any, value: Any = None) -> None:
    """Add to a bounded memory: it keeps the latest ``REMEMBERED`` keys."""
    memory[key] = value
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)


@dataclass(eq=False)
class BlockRun:
    """One block of one run here: its spec (once known), the imports received, its state."""

    block: int
    spec: BlockSpec | None = None
    imports: dict[str, torch.Tensor] = field(default_factory=dict)
    state: str = WAITING
    resolving: bool = False               # its spec is being loaded
    deferred: bool = False                # ready, held until the run it follows wrote its cache here
    sending: list[asyncio.Future[Any]] = field(default_factory=list)   # run on the event loop: its
    # sends not yet on the wire when it finished (an idle stream takes one at once)

    @property
    def ready(self) -> bool:
        return self.spec is not None and self.state == WAITING and all(t in self.imports
                                                                       for t in self.spec.imports)

    def missing(self) -> list[str]:
        return [t for t in (self.spec.imports if self.spec is not None else ()) if t not in self.imports]


@dataclass(eq=False)
class Run:
    """One request of one model on one worker (see module doc)."""

    keeper: Keeper = field(repr=False)
    model: str
    version: int
    request: int
    created: float = field(default_factory=time.monotonic)
    blocks: dict[int, BlockRun] = field(default_factory=dict)
    outputs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[Any] = field(default_factory=set)
    wanted: set[int] = field(default_factory=set)     # blocks a caller waits here for
    after: int = -1                   # the request (a prompt's chunk before) whose cache writes it needs
    ticket: str = ""                  # the caller's, as its messages carried it: failures spread with it
    # NOTE: a decode step's inputs of a peer's blocks, to go with this run's first push to that peer
    riders: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = field(default_factory=dict)
    chain: Chain | None = None        # its logits block, chained to the next step's first blocks

    @property
    def key(self) -> RunKey:
        return self.model, self.request

    def block(self, b: int) -> BlockRun:
        br = self.blocks.get(b)
        if br is None:
            br = self.blocks[b] = BlockRun(b)
        return br

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        """Every block that was named here ran, and the caller took every output it waits for."""
        return all(b.state == DONE for b in self.blocks.values()) and not self.outputs and not self.wanted

    def progress(self) -> list[int]:
        """[blocks running or about to (or held behind the run they follow, which moves),
        blocks done, tensors received, outputs waiting]."""
        return [sum(b.state == RUNNING or b.resolving or b.deferred for b in self.blocks.values()),
                sum(b.state == DONE for b in self.blocks.values()),
                sum(len(b.imports) for b in self.blocks.values()), len(self.outputs)]

    @property
    def held_bytes(self) -> int:
        held = [t for b in self.blocks.values() for t in b.imports.values()]
        held += [t for out in self.outputs.values() for t in out.values()]
        held += [t for feeds in self.riders.values() for _, ts in feeds for t in ts.values()]
        return sum(int(t.numel() * t.element_size()) for t in held)

    def where(self) -> str:
        return f"request {self.request} of model {self.model} (plan v{self.version})"

    # --- receiving -----------------------------------------------------------------------------
    def deliver(self, block: int, tensors: Mapping[str, torch.Tensor], ticket: str,
                inline: bool = True) -> bool:
        """Inputs of ``block``; it starts once it has them all. False for a repeat. ``inline``
        False: it never runs on the event loop (``start``)."""
        keeper = self.keeper
        if (self.model, self.request, block) in keeper.ran:
            keeper.counters["repeats"] += 1
            return False
        self.ticket = self.ticket or ticket
        br = self.block(block)
        new = {t: x for t, x in tensors.items() if t not in br.imports}
        if br.state != WAITING or (tensors and not new):
            keeper.counters["repeats"] += 1
            return False
        br.imports.update(new)
        if br.spec is None and not br.resolving:
            br.spec = keeper.host.spec_of(self.model, self.version, block)
            if br.spec is None:
                br.resolving = True
                self._spawn(self._resolve(br, ticket))
        if br.spec is not None:
            self._check_imports(br)
            self.start(br, ticket, inline)
        return True

    async def collect(self, blocks: list[int], tokens: str = "") -> dict[int, Tensors]:
        """The outputs of ``blocks`` once made, taken (``tokens``: an output tile that is taken as
        its greedy tokens instead); the run's error if it fails first."""
        while self.error is None and not all(b in self.outputs for b in blocks):
            self.wanted.update(blocks)       # NOTE: the run stays here while a caller waits on it
            await self.changed.wait()
        if self.error is not None:
            raise self.error
        kept = self.keeper.picked.pop(self.key, None)
        if isinstance(kept, BaseException):
            raise RunFailed(f"{self.where()}: its rows' tokens could not be picked ({kept})")
        made, picked = kept if kept is not None else ("", None)

        def taken(t: str, x: torch.Tensor) -> torch.Tensor:
            if t != tokens:
                return x
            return greedy(x) if picked is None else torch.from_numpy(picked[0])

        out = {b: Tensors({t: taken(t, x) for t, x in self.outputs.pop(b).items()}) for b in blocks}
        if picked is not None:
            for ts in out.values():
                if tokens and tokens in ts:
                    ts.update(picked[1])
                elif not tokens and made in ts:
                    # NOTE: a loop's first step goes back as logits: its picks go with them, so its
                    # caller hands out the tokens the next step was fed, not a pick of its own
                    ts[PICKED] = torch.from_numpy(picked[0])
                    ts.update(picked[1])
        lane = self.keeper.lane_rows.pop(self.key, None) if tokens else None
        if lane is not None:
            for ts in out.values():
                if tokens in ts:
                    ts[ROWS], ts[EDITS] = lane[0], torch.tensor([lane[1]], dtype=torch.long)
        self.wanted.difference_update(blocks)
        self.tidy()
        return out

    # --- starting blocks -----------------------------------------------------------------------
    def start(self, br: BlockRun, ticket: str, inline: bool = True) -> None:
        """Run ``br`` if it has its inputs (and the cache writes it follows); ``inline`` False: on a
        compute thread whatever it costs (``_makes_logits``)."""
        if not br.ready or self._held(br, ticket):
            return
        br.state = RUNNING      # NOTE: at once, so a repeat that comes meanwhile starts nothing
        keeper = self.keeper
        args = (self.model, self.version, self.request, br.block, br.imports)
        # NOTE: a resident block whose last run took less than INLINE_S runs on the event loop:
        # the two hand-offs to a compute thread would cost more than the block; so does one that is
        # the worker's only work (``_alone``). Any other is handed to a compute thread now, before
        # the loop writes replies or sends anything
        if inline and ((keeper.last_s.get((self.model, br.block), INLINE_S) < INLINE_S
                        and self._inline(br.block)) or self._alone(br)):
            self._here(br, ticket)
            return
        chain = self._chain(br, args)
        if chain is None:
            self._spawn(self._compute(br, ticket, self._submit(args)))
            return
        self.chain = chain
        made = keeper.host.executor.submit_ordered(self.created, chain)      # type: ignore[attr-defined]
        self._spawn(self._compute(br, ticket, asyncio.wrap_future(made), chain))

    def _here(self, br: BlockRun, ticket: str) -> None:
        """Run ``br`` on the event loop now, not in a task a loop turn later (0.1 ms a block on 2
        cores): its outputs go out before this returns (``br.sending``: those that wait to)."""
        try:
            out, record = self.keeper.host.compute(self.model, self.version, self.request, br.block,
                                                   br.imports)
        except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
            self.fail(e, ticket)
            return
        sends, ahead = self._finish(br, ticket, out, record)
        br.sending = [f for f in sends if not f.done()]
        self._spawn(self._settle(sends, ahead))

    def _held(self, br: BlockRun, ticket: str) -> bool:
        """Whether ``br`` waits for the run this one follows to cache what it reads here (a
        prompt's chunk before); a run whose predecessor ended first fails (it could never start)."""
        br.deferred = False
        if self.after < 0:
            return False
        keeper = self.keeper
        try:
            if keeper.host.ready(self.model, self.version, br.block, br.imports):
                return False
        except Exception as e:  # noqa: BLE001 - then the kernel's own check (CacheLost) has the last word
            logger.warning("seabiscuit: block b%s of %s not checked for its cache: %s", br.block,
                           self.where(), e)
            return False
        before = (self.model, self.after)
        if before in keeper.ended or (before in keeper.done and not keeper.holds(before)):
            why = (f"{self.where()} follows request {self.after}, which ended before it cached what block "
                   f"b{br.block} reads on worker {keeper.host.address}")
            self.fail(RunFailed(why), ticket)
            return True
        br.deferred = True
        keeper.hold(self, ticket)
        return True

    def _alone(self, br: BlockRun) -> bool:
        """Whether ``br`` runs on the event loop as this worker's only work: its compute threads idle,
        no other block here waits or runs, its last run under ``ALONE_S``, resident with no check
        due (``_inline``). A decode step is such a block on each worker in turn: handed to a thread
        it waits for the thread to wake and for the GIL the loop holds (0.3 ms on 2 cores), and the
        loop waits to wake for its outputs (0.3 ms more); on the loop, its outputs go at once.
        Messages that come meanwhile wait for it, as they would for the compute thread."""
        idle = getattr(self.keeper.host.executor, "idle", None)
        if idle is None or not idle() or self.keeper.last_s.get((self.model, br.block), ALONE_S) >= ALONE_S \
                or not self._inline(br.block):
            return False
        return self.keeper.alone(self, br)

    def _chain(self, br: BlockRun, args: ComputeArgs) -> Chain | None:
        """A ``Chain`` of ``br`` and the next decode step's blocks here, where ``br`` makes the
        logits of a loop that goes on and each of those blocks is resident, reads only the step's
        inputs and does not make the logits itself; else None."""
        loop, host = self.keeper.loops.get(self.key), self.keeper.host
        pending = getattr(host.executor, "pending", None)
        if loop is None or not loop.requests or pending is None or br.spec is None \
                or loop.logits not in br.spec.exports:
            return None
        feeds = [(b, names) for address, fs in loop.route if address == host.address for b, names in fs]
        for b, names in feeds:
            spec = host.spec_of(self.model, self.version, b)
            # NOTE: nor where a next block makes the logits itself (the whole step here, one worker): its
            # caller would hear of this step's tokens only once the next step was computed, two at a time
            if spec is None or not set(spec.imports) <= set(names) or not self._inline(b) \
                    or loop.logits in spec.exports:
                return None
        return Chain(host.compute, args, loop, feeds, lambda: pending() == 0) if feeds else None

    def _submit(self, args: ComputeArgs) -> Awaitable[Outcome]:
        """The block on a compute thread; the oldest run's blocks first (``ordered``): a stage hands
        a request on down the pipeline before it starts the next one."""
        host = self.keeper.host
        ordered = getattr(host.executor, "submit_ordered", None)
        if ordered is not None:
            running = asyncio.wrap_future(ordered(self.created, host.compute, *args))
        else:
            running = asyncio.get_running_loop().run_in_executor(host.executor, host.compute, *args)
        # NOTE: a run forgotten before its task awaited this leaves a failure nobody reads: not an
        # error to log (the task awaiting it, when it does, still gets it)
        running.add_done_callback(lambda f: f.cancelled() or f.exception())
        return running

    def _inline(self, block: int) -> bool:
        """Whether the block may run on the event loop now: resident at the run's plan, with no tile
        check or checkpoint due (either could read files, or fetch its spec from the scheduler by an
        RPC the blocked loop could never answer)."""
        spec = self.keeper.host.spec_of(self.model, self.version, block)
        return spec is not None and spec.verify_every <= 0 and not spec.checkpoint_dir

    def _check_imports(self, br: BlockRun) -> None:
        assert br.spec is not None
        extra = [t for t in br.imports if t not in br.spec.imports]
        if extra:
            raise BadMessage(f"block b{br.block} of {self.where()} reads no tensor {extra[0]!r} "
                             f"(it reads {list(br.spec.imports)[:5]})")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _resolve(self, br: BlockRun, ticket: str) -> None:
        """Load ``br``'s spec off the event loop, then start it; if it cannot load, the run fails
        (and, its spec described, the blocks after it hear of it)."""
        host = self.keeper.host
        try:
            br.spec = await asyncio.get_running_loop().run_in_executor(
                host.executor, host.load_spec, self.model, self.version, br.block)
            br.resolving = False        # NOTE: else ``status`` says it runs while the run waits on others
            self._check_imports(br)
        except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
            br.resolving = False
            if br.spec is None:
                try:
                    br.spec = await asyncio.get_running_loop().run_in_executor(
                        host.executor, host.describe, self.model, self.version, br.block)
                except Exception as why:  # noqa: BLE001 - then only what is known hears of it
                    logger.warning("seabiscuit: the blocks after b%s of %s are not told it failed: %s",
                                   br.block, self.where(), why)
            self.fail(e, ticket)
            return
        self.start(br, ticket)

    # --- a block ran ---------------------------------------------------------------------------
    async def _compute(self, br: BlockRun, ticket: str, running: Awaitable[Outcome],
                       chain: Chain | None = None) -> None:
        """The block's outputs, from ``running`` (its compute thread); ``chain``: the block makes a
        loop's logits, and its next step may be running already."""
        try:
            out, record = await running
        except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
            self.fail(e, ticket)
            return
        finally:
            if chain is not None and self.chain is chain:
                self.chain = None
        await self._settle(*self._finish(br, ticket, out, record, chain))

    def _finish(self, br: BlockRun, ticket: str, out: dict[str, torch.Tensor], record: dict[str, Any],
                chain: Chain | None = None) -> tuple[list[Any], list[Any]]:
        """A block ran: the next decode step starts, the blocks that read its outputs are sent them,
        the caller's copy of them is kept; in that order (the critical path first). Returns the
        sends, and those of the next step's blocks that ran chained (``ahead``): while any is on
        its way the caller is not yet told of these outputs."""
        spec = br.spec
        assert spec is not None
        keeper = self.keeper
        keeper.last_s[(self.model, br.block)] = float(record.get("compute_s", INLINE_S))
        br.imports, br.state = {}, DONE
        remember(keeper.ran, (self.model, self.request, br.block))
        keeper.records.append(record)
        ahead: list[Any] = []
        follows = keeper.loops.get(self.key)
        if follows is not None and follows.logits in out:
            ahead = self.advance(out[follows.logits], ticket, chain)
        # NOTE: started now, so they go before anything this wakes (the caller's collect)
        sends = [self._send(c, addr, {t: out[t] for t in ts}, ticket) for c, addr, ts in spec.sends]
        if spec.outputs:
            self.outputs[br.block] = {t: out[t] for t in spec.outputs}
            if not ahead:
                self.notify()
        keeper.wake(self.model)
        return sends, ahead

    async def _settle(self, sends: Sequence[Awaitable[Any]], ahead: Sequence[Any] = ()) -> None:
        """Wait for a block's sends; with ``ahead`` (``_finish``), tell the caller of its outputs
        ``token_delay`` after those are on their way (a caller that asks later has them at once)."""
        if ahead:
            await asyncio.wait(ahead)
            if self.keeper.token_delay > 0:
                # NOTE: the caller's wake-up then waits for the next worker's (``DataPlane.token_delay``)
                asyncio.get_running_loop().call_later(self.keeper.token_delay, self.notify)
            else:
                self.notify()
        await asyncio.gather(*sends)
        self.tidy()

    # --- the decode loop that follows ----------------------------------------------------------
    def advance(self, logits: torch.Tensor, ticket: str, chain: Chain | None = None) -> list[Any]:
        """Feed the next step of the decode loop that follows this run from its greedy tokens; with
        a ``chain`` that picked them (and may run the step's blocks here), from its pick. Returns
        the sends of the next step's blocks that ran chained."""
        keeper = self.keeper
        loop = keeper.loops.pop(self.key, None)
        # NOTE: a chain that ran the next step picked this one's tokens already, and its lane's
        # pickers are the next step's rows' since: what it picked (or greedy) stands
        chained = chain is not None and loop is not None and chain.loop is loop and chain.step is not None
        if loop is not None and (loop.picked is not None or (loop.picks and not chained)):
            # NOTE: its rows' own picks, which its caller reads in place of the greedy tokens
            try:
                remember(keeper.picked, self.key, (loop.logits, loop.pick(logits)))
            except Exception as e:  # noqa: BLE001 - this step's caller hears it; the next step fails below
                # NOTE: its words only: the error's frames would hold the logits
                remember(keeper.picked, self.key, RunFailed(f"{type(e).__name__}: {e}"))
        if loop is None or not loop.requests or (self.model, loop.requests[0]) in keeper.ended:
            if loop is not None and loop.lane is not None:
                loop.lane.close()
            return []       # NOTE: the caller stopped the loop (forgot its next step)
        nxt = keeper.get(self.model, self.version, loop.requests[0])
        if nxt is None:
            if loop.lane is not None:
                loop.lane.close()
            return []
        if chained:
            assert chain is not None and chain.step is not None
            inputs, after = chain.step
        else:
            chain = None
            try:
                inputs, after = loop.following(logits)
            except Exception as e:  # noqa: BLE001 - the next step fails with it; its caller hears
                if loop.lane is not None:
                    loop.lane.close()
                nxt.fail(RunFailed(f"{nxt.where()}: its inputs could not be made from the step before "
                                   f"({type(e).__name__}: {e})"), ticket, spread=False)
                return []
        if loop.lane is not None:
            # NOTE: kept by the run manager, not the run: a run with no block here yet may be let go
            # and made again by the next message of it
            rows = inputs["sb_sessions"]
            remember(keeper.lane_rows, nxt.key, (rows, loop.lane.applied_by(nxt.request)))
            if not bool((rows >= 0).any()):
                # NOTE: every row of the lane ended: no step of pad rows runs on; a caller that reads
                # it (a join came too late) starts the loop anew
                nxt.fail(LaneStopped(f"{nxt.where()}: every row of its lane ended, so its loop stopped "
                                     "there; the lane starts anew"), ticket, spread=False)
                return []
        if after.requests or after.picks:       # NOTE: a last step's rows still pick their tokens
            keeper.loops[nxt.key] = after
            # NOTE: once this step is on its way, not on the path of the next one's tokens
            asyncio.get_running_loop().call_soon(after.prepare)
        keeper.counters["loop_steps"] += 1
        return nxt._take_step(loop, inputs, ticket, chain)

    def _take_step(self, loop: Loop, inputs: dict[str, torch.Tensor], ticket: str,
                   chain: Chain | None) -> list[Any]:
        """This run as a decode loop's next step, fed ``inputs``: the peers' step inputs are dealt
        with before the blocks here start; each goes with the push of the block here that its
        blocks read (``_carrier``: one message, and nothing between the logits and the next
        step), else out now. Returns the sends of the blocks here that ran chained (or on the
        event loop): the caller's tokens go after them."""
        me = self.keeper.host.address
        ahead: list[Any] = []
        route = sorted(loop.route, key=lambda r: r[0] == me)
        here = [b for address, feeds in loop.route if address == me for b, _ in feeds]
        for address, feeds in route:
            mine = [(b, {t: inputs[t] for t in names}) for b, names in feeds]
            if address == me:
                for b, ts in mine:
                    if chain is not None and chain.ran:
                        ahead += self._adopt(b, ts, chain.next[b], ticket)
                    elif self.deliver(b, ts, ticket, inline=not self._makes_logits(b, loop)):
                        # NOTE: it ran on the loop: the tokens go once its sends are on the wire (at
                        # once where they are: no task in between, each a loop turn behind the rest)
                        ahead += self.block(b).sending
            elif self._carrier(here, address, [b for b, _ in feeds]):
                self.riders.setdefault(address, []).extend(mine)
            else:
                self._feed_peer(address, mine, ticket)
        return ahead

    def _makes_logits(self, block: int, loop: Loop) -> bool:
        """Whether ``block`` makes ``loop``'s logits (or is not known here yet). Such a block fed
        from the step before on this worker runs on a compute thread: on the event loop it would
        feed the next step at once, and the one after, all in one turn of the loop, and no step's
        tokens could reach their caller, nor the caller's edits the loop, until the last."""
        spec = self.keeper.host.spec_of(self.model, self.version, block)
        return spec is None or loop.logits in spec.exports

    def _carrier(self, here: list[int], address: str, blocks: list[int]) -> bool:
        """Whether a block of this run fed here, not yet started, sends to every one of ``blocks`` at
        ``address``: their step inputs can go with its push. They need its outputs anyway, and if it
        fails they hear of that as its downstream."""
        for b in here:
            spec = self.keeper.host.spec_of(self.model, self.version, b)
            br = self.blocks.get(b)
            if spec is None or (br is not None and (br.state != WAITING or br.imports)):
                continue
            if set(blocks) <= {c for c, a, _ in spec.sends if a == address}:
                return True
        return False

    def _adopt(self, block: int, tensors: Mapping[str, torch.Tensor],
               running: concurrent.futures.Future[Outcome], ticket: str) -> list[Any]:
        """``block``, which a ``Chain`` ran with ``tensors`` (its outcome in ``running``): it goes on
        from here as if it ran here; returns its sends. A repeat (the block ran or runs already)
        is dropped."""
        keeper = self.keeper
        br = self.block(block)
        if (self.model, self.request, block) in keeper.ran or br.state != WAITING or br.imports:
            keeper.counters["repeats"] += 1
            return []
        br.imports.update(tensors)
        br.spec = br.spec or keeper.host.spec_of(self.model, self.version, block)
        br.state = RUNNING
        if br.spec is None:         # NOTE: its plan was retired here meanwhile: where would it send?
            self.fail(StaleRun(f"block b{block} of {self.where()} is no longer held by worker "
                               f"{keeper.host.address}: the step runs again on the current plan"), ticket)
            return []
        keeper.counters["chained"] += 1
        if not running.done() or running.cancelled() or running.exception() is not None:
            self._spawn(self._compute(br, ticket, asyncio.wrap_future(running)))
            return []
        return [self._spawn(self._settle(*self._finish(br, ticket, *running.result())))]

    # --- sending -------------------------------------------------------------------------------
    def _feed_peer(self, address: str, feeds: list[tuple[int, dict[str, torch.Tensor]]],
                   ticket: str) -> asyncio.Future[Any]:
        return self._post(address, "seabiscuit_dp_feed", ticket, "feed the next decode step to",
                          inputs=[(b, Tensors(ts)) for b, ts in feeds])

    def _send(self, block: int, address: str, tensors: dict[str, torch.Tensor],
              ticket: str) -> asyncio.Future[Any]:
        if address == self.keeper.host.address:
            return self.keeper.tell(self._local(block, tensors, ticket))
        riders = self.riders.pop(address, None)
        extra = {"inputs": [(b, Tensors(ts)) for b, ts in riders]} if riders else {}
        return self._post(address, "seabiscuit_dp_push", ticket, f"send the inputs of block b{block} to",
                          block=block, tensors=Tensors(tensors), **extra)

    async def _local(self, block: int, tensors: dict[str, torch.Tensor], ticket: str) -> None:
        if self.keeper.holds(self.key):
            self.deliver(block, tensors, ticket)

    def _post(self, address: str, op: str, ticket: str, what: str, **msg: Any) -> asyncio.Future[Any]:
        """Send ``op`` of this run to ``address`` now: down an idle stream it is written before this
        returns, not a loop turn later behind whatever else the loop has queued (a decode step's
        hop waits on it). The future of its sending (done where it went at once), else held by the
        keeper (``tell``); if it cannot be sent the run fails, everywhere (``what``: what could not
        be done)."""
        host = self.keeper.host
        try:
            sent = host.send(address, op, model=self.model, ticket=ticket, version=self.version,
                             request=self.request, **msg)
        except BaseException as e:  # noqa: BLE001 - the run fails below, as for a send that fails later
            sent = asyncio.get_running_loop().create_future()
            sent.set_exception(e)
        if isinstance(sent, asyncio.Future) and sent.done() and not sent.cancelled() \
                and sent.exception() is None:
            return sent         # NOTE: on the wire already (an idle stream): nothing to wait for

        async def sending() -> None:
            try:
                await sent
            except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
                self.fail(RunFailed(f"{self.where()}: worker {host.address} could not {what} {address}: "
                                    f"{type(e).__name__}: {e}"), ticket)
        return self.keeper.tell(sending())

    # --- ending --------------------------------------------------------------------------------
    def tidy(self) -> None:
        """Drop the run once every block named here ran and the caller took what it waits for."""
        if self.finished and self.error is None:
            self.keeper.drop(self, None)

    def fail(self, error: BaseException, ticket: str, spread: bool = True) -> None:
        """Fail the run here; with ``spread``, at the workers of every block downstream of it too."""
        if self.error is not None:
            return
        keeper = self.keeper
        if not isinstance(error, SeaBiscuitError):      # NOTE: the block itself failed: no retry cures it
            error = BlockFailed(f"{self.where()} failed in a block on worker {keeper.host.address}: "
                                f"{type(error).__name__}: {error}")
        keeper.counters["runs_failed"] += 1
        self.end(error)
        keeper.drop(self, error)
        if spread and ticket:
            kind = type(error).__name__
            for block, addr in downstream(keeper.host, self.model, self.version,
                                          [b.spec for b in self.blocks.values() if b.spec is not None]):
                keeper.tell(tell_failed(keeper.host, addr, self.model, self.version, self.request, ticket,
                                        str(error), block, kind=kind))
            for b in self.blocks.values():
                if b.spec is None:          # NOTE: its spec still loading: where its outputs go is asked
                    keeper.tell(keeper.pass_on(self.model, self.version, self.request, b.block, ticket,
                                               str(error)[:2000], kind))

    def end(self, error: BaseException) -> None:
        """The run ends with ``error`` here (its callers hear of it; its chain runs no next step)."""
        if self.error is None:
            self.error = error
        if self.chain is not None:
            self.chain.stopped = True
        self.notify()

    def forget(self, error: BaseException) -> None:
        """The caller is done with the run: it ends with ``error``, and what it still runs is
        cancelled."""
        self.end(error)
        for t in self.tasks:
            t.cancel()


def downstream(host: Host, model: str, version: int, specs: list[BlockSpec]) -> set[tuple[int, str]]:
    """The blocks on other workers that wait, directly or through blocks here, on ``specs``."""
    out: set[tuple[int, str]] = set()
    todo = list(specs)
    seen: set[int] = set()
    while todo:
        spec = todo.pop()
        for c, addr, _ in spec.sends:
            if addr != host.address:
                out.add((c, addr))
            elif c not in seen:
                seen.add(c)
                local = host.spec_of(model, version, c)
                if local is not None:
                    todo.append(local)
    return out


async def tell_failed(host: Host, address: str, model: str, version: int, request: int, ticket: str,
                      reason: str, block: int = -1, kind: str = "") -> None:
    """Tell ``address`` that a run failed (before ``block`` there, if one is named)."""
    try:
        await host.send(address, "seabiscuit_dp_fail", model=model, ticket=ticket, version=version,
                        request=request, reason=reason, block=block, kind=kind if kind in KINDS else "")
    except Exception as e:  # noqa: BLE001 - a peer gone has nothing to fail
        logger.debug("seabiscuit: %s not told of the failure of request %s: %s", address, request, e)
