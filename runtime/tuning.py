"""The runtime's tuning constants, in one place, each with what it trades.

None of them is a user setting (those are the frozen dataclasses of `config.py`): each is a
trade-off measured once and fixed, which changes how fast or how smoothly the engine runs, never
what a request produces. The modules that use them import them from here; tests that patch one
patch it on the module that reads it. The kernels' own crossovers are in `kernels/tuning.py`.
"""

from __future__ import annotations

# Tokenizing (tokenizer.py, engine.py) -------------------------------------------------------------

# From this many characters on, `encode` goes through the backend's batch call, which releases the
# GIL while it works (its single-text call holds it for the whole encode, and for a long text the
# engine loop and the HTTP server's event loop stand still meanwhile), and the engine tokenizes off
# the event loop. Below it, the thread hop costs more than the encode.
GIL_FREE_CHARS = 4096

# Detokenizing (detokenizer.py) --------------------------------------------------------------------

# Prompt tokens decoded ahead of the first output token, so that its text (a leading space, a
# merged byte sequence) comes out as the tokenizer would write it in context.
PROMPT_CONTEXT_TOKENS = 5
# Ids in a row that each end inside a UTF-8 sequence before the text is emitted anyway (with
# replacement characters): a stream never stalls on invalid bytes, at the price of showing them.
MAX_PENDING_TOKENS = 32

# Scheduling (scheduler.py, schedule_policy.py) ----------------------------------------------------

# The share of each running request's remaining `max_new_tokens` the scheduler reserves KV for when
# admitting new work: it starts high (few retractions), decays per step down to the minimum while
# nothing is retracted (more requests admitted), and resets on a retraction (as SGLang does).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
# A waiting request that shares at least this many uncached tokens with a request admitted in the
# same step waits one step, so it reuses that prefix from the cache instead of recomputing it.
IN_BATCH_PREFIX_THRESHOLD = 32
# Beyond this many waiting requests, prefix matching costs more than ordering saves (SGLang: 128):
# the queue is taken first come, first served.
MAX_MATCHED_WAITING = 128
# Sliding-window models: a request keeps its window pages this many tokens longer than its window
# needs. A jump-forward that retokenizes the tail recomputes it from a few tokens back; a rewind
# further than this retracts the request (it then recomputes from its longest usable prefix).
REWIND_SLACK_TOKENS = 32
# The window-layer pool holds at least this many requests' windows (plus a prefill chunk each),
# and at least this share of the full pool's pages.
WINDOW_POOL_MIN_REQUESTS = 2
WINDOW_POOL_MIN_SHARE = 0.25

# Governors (governor.py, speculative/governor.py) -------------------------------------------------

# Weight of the old value in each way's moving average of work per second: higher is steadier,
# lower notices a change sooner.
GOVERNOR_EMA = 0.8
# Every EXPLORE_EVERY steps of a bucket, the way not chosen runs for EXPLORE_STEPS steps, so that a
# change of workload or of load on the machine is noticed; each such step may be the slower way.
EXPLORE_EVERY = 96
EXPLORE_STEPS = 2

# Speculative decoding's per-request gate (speculative/base.py) ------------------------------------

# Below this running mean of accepted drafts per proposal, a request stops speculating for a while
# (drafts that are rejected cost a verification each); each failed retry doubles the pause, from
# BACKOFF_STEPS up to MAX_BACKOFF_STEPS, and a success resets it.
MIN_MEAN_ACCEPTED = 0.6
BACKOFF_STEPS = 16
MAX_BACKOFF_STEPS = 512
# Weight of the old value in that running mean.
SPECULATION_GATE_EMA = 0.7

# Decode bursts (bursts.py) -------------------------------------------------------------

# A decode burst (`num_continuous_decode_steps`) lasts about this long at most: longer bursts save
# per-step overhead, but a request that is not streamed gets its result only when the burst ends.
BURST_SECONDS = 0.05
# With speculative decoding on, a step whose drafter found nothing to propose still runs as a short
# burst: the drafter looks again after this many steps (a copy that starts mid-burst waits for it).
SPECULATIVE_BURST_STEPS = 4

# Budget-aware closing (budget_closing.py, engine.py) --------------------------------------------

# Tokens of room kept beyond what a step adds, for what that step's tokens may open: a token that
# starts an optional property commits the closing to the rest of its name and a value (~8 tokens
# for a camel-case key), so with less kept a budget a little above the shortest instance runs out.
CLOSING_GROWTH = 8
# At submit, the longest shortest-output looked for, and the time that search may take (off the
# engine loop): a larger probe rejects fewer requests as unclosable, at a slower submit.
CLOSING_PROBE_TOKENS = 4096
CLOSING_PROBE_SECONDS = 0.5
# The closing length assumed until a search finds one (the submit probe may find none in its time).
CLOSING_MIN_EXPECTED = 24
# How much longer the closing may get per token sampled since it was last found (a token can open
# a string, an object and an array at once, most open nothing): the engine looks again once the
# room is within that prediction.
CLOSING_GROWTH_PER_TOKEN = 2
# The time one closing search may take on the engine loop (every running request waits for it), and
# the searches that found nothing before a request stops looking.
CLOSING_STEP_SECONDS = 0.02
# A closing expected to be longer than this is looked for off the engine loop (`closing_jobs.py`),
# its request out of the batches meanwhile, with more time: deep documents need a hundred tokens.
CLOSING_INLINE_MAX_TOKENS = 40
CLOSING_BACKGROUND_SECONDS = 0.5
CLOSING_WAIT_SECONDS = 0.01  # the loop's nap when every running request waits for its search
CLOSING_MAX_MISSES = 4
# A steering request's alternatives to a sampled token after which no closing fits: the model's
# next-best allowed tokens, tried in order before the closing's own token.
CLOSING_CANDIDATES = 8


# KV tiers below the pool (kv_tiers/) --------------------------------------------------------------

# Tokens per stored block (rounded up to whole pages): each block is one file or one Redis value
# and one lookup. Smaller blocks catch shorter shared prefixes; larger ones cost fewer files and
# round trips per prompt (64 tokens of SmolLM2 in float32 are 2.9 MB).
TIER_BLOCK_TOKENS = 64
# A waiting request is held for its blocks at most as long as prefilling them would take. Until
# the engine has timed a prefill, it assumes this rate (on the fast side: a hold never outlasts the
# prefill it saves by much on a CPU; a GPU's first measured step corrects it).
TIER_ASSUMED_PREFILL_TOKENS_PER_S = 2000.0
TIER_MIN_HOLD_SECONDS = 0.005
# Snapshots of cached pages waiting for the writer; beyond this, new ones are not written (a tier
# slower than the engine caches less, the engine never waits for it).
TIER_MAX_PENDING_WRITE_BYTES = 512 * 1024 * 1024
# At shutdown, how long the writer may take to store what is queued.
TIER_FLUSH_SECONDS = 30.0

# Prefill–decode handoff (kv_tiers/handoff.py) --------------------------------------------------

# Imported pages are held (unevictable) until the request they were sent for is admitted; the
# router sends it right after the import, so this bounds only runs whose request never came (a
# router that died between the two). Short: held pages are pages other requests cannot have.
HANDOFF_HOLD_SECONDS = 10.0
# At most this share of the pool is held for requests still to come; older holds end first.
HANDOFF_MAX_HELD_FRACTION = 0.5
