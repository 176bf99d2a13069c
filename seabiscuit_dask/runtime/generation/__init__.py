"""Text generation: sessions over a KV cache, continuous batching, streaming, replay.

Laid out as an engine in the manner of vLLM v1, each part a module:

- ``scheduler``: ``Scheduler.schedule()`` decides each step (which calls are admitted and
  how their prompts are cut into chunks, which rows decode in which group) and returns
  it as a plain, printable ``SchedulerOutput`` (``output``);
- ``executor``: ``Executor`` carries a record out through the runner, retrying and replaying
  after a worker loss;
- ``sessions``: sessions and their token histories, the calls that answer them, and the
  count of those open; ``kv``: what the caller knows and owes of their caches;
- ``engine``: ``Engine``, the loop that ties them, on a thread of its own;
- ``runner``: the ``Runner`` protocol the engine calls (``DistributedModel`` on a
  cluster, ``LocalRunner`` in this process); ``inputs``: a step program's inputs;
  ``sampling``: greedy and sampled picks, logit rules and log-probabilities; ``grammar``:
  constrained decoding (JSON schemas, Lark grammars); ``hf``:
  Hugging Face's ``generate`` face.

The engine is independent of Dask: a runner runs one step program (locally in tests,
on the cluster for a ``DistributedModel``).
"""

from .engine import Engine
from .executor import EngineStats, Executor
from .grammar import Grammar, GrammarError, json_grammar, lark_grammar
from .hf import GenerateArgs, TokenStream, generate_tokens, prompts_of, stream_tokens
from .inputs import STEP_INPUTS, step_inputs
from .kv import KVLedger
from .output import Admission, Chunk, DecodeGroup, Prefill, PrefillGroup, SchedulerOutput
from .runner import LocalRunner, Runner
from .sampling import History, LogitRules, Sampling, TokenLogprob, greedy
from .scheduler import Scheduler, SchedulerSpec, batch_buckets, chunking, decode_rows, prefill_buckets
from .sessions import Call, Session, SessionTable

__all__ = ["STEP_INPUTS", "Admission", "Call", "Chunk", "DecodeGroup", "Engine", "EngineStats", "Executor",
           "GenerateArgs", "Grammar", "GrammarError", "History", "KVLedger", "LocalRunner", "LogitRules",
           "Prefill", "PrefillGroup", "Runner", "Sampling", "Scheduler", "SchedulerOutput", "SchedulerSpec",
           "Session", "SessionTable", "TokenLogprob", "TokenStream", "batch_buckets", "chunking",
           "decode_rows", "generate_tokens", "greedy", "json_grammar", "lark_grammar", "prefill_buckets",
           "prompts_of", "step_inputs", "stream_tokens"]
