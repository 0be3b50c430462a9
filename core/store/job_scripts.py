"""The Lua scripts of the job store (core.store.jobstore): a record's claim (alone, or
in the message's push), a delivery's begin, and the one final outcome, each run whole by
Redis so that no crash or race can leave a job half written."""

from core.store.batch_scripts import RECORD_LINE_FN

# One script per job, all jobs in one pipeline: create the record only if the id is
# new, so resubmitting a job id never enqueues it twice. KEYS[{r}]: the record;
# ARGV[{t}]: its TTL, then its fields as name, value pairs.
CLAIM_BODY = """
if redis.call('HSETNX', KEYS[{r}], 'status', 'queued') == 0 then return 0 end
for i = {t} + 1, #ARGV, 2 do redis.call('HSET', KEYS[{r}], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[{r}], ARGV[{t}])
"""

CLAIM = CLAIM_BODY.format(r=1, t=1) + "return 1"

# The claim and the message's push in one script (dispatcher.push_guard runs it
# in place of kombu's LPUSH): no round trip of its own, and the record exists exactly
# when the message was pushed, even when a pipeline of them fails midway. KEYS[1]: the
# queue's list, ARGV[1]: the message (both added by the transport). First the premise
# of the job's decision (ARGV[2]: the fleet epoch its view was read at, '' for none;
# KEYS[3]: the epoch's key, KEYS[4..]: the view's heartbeat keys): -1, nothing
# written, when the fleet changed since, so the client decides again on a fresh read.
CLAIM_AND_PUSH = (
    """
if ARGV[2] ~= '' then
    if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[2] then return -1 end
    for i = 4, #KEYS do if redis.call('EXISTS', KEYS[i]) == 0 then return -1 end end
end
"""
    + CLAIM_BODY.format(r=2, t=3)
    + "redis.call('LPUSH', KEYS[1], ARGV[1])\nreturn 1"
)

# A group's claim and its one message's push (ib.generate_group): every record is
# created, or none when any id is known already (the client then sends the group's
# jobs one by one, where a known id is skipped), and the message is pushed only then.
# KEYS[1]: the queue's list, KEYS[2]: the fleet epoch's key, KEYS[3..2+ARGV[3]]: the
# view's heartbeat keys, then the records; ARGV[1]: the message, ARGV[2]: the epoch
# ('' for none), ARGV[4]: the TTL, then per record its field count and its fields.
# Replies as CLAIM_AND_PUSH: 1 pushed, 0 an id known, -1 the fleet changed.
CLAIM_GROUP_AND_PUSH = """
local first = 3 + tonumber(ARGV[3])
if ARGV[2] ~= '' then
    if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[2] then return -1 end
    for i = 3, first - 1 do if redis.call('EXISTS', KEYS[i]) == 0 then return -1 end end
end
for i = first, #KEYS do if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end end
local a = 5
for i = first, #KEYS do
    local n = tonumber(ARGV[a])
    redis.call('HSET', KEYS[i], 'status', 'queued')
    for j = a + 1, a + 2 * n, 2 do redis.call('HSET', KEYS[i], ARGV[j], ARGV[j + 1]) end
    redis.call('EXPIRE', KEYS[i], ARGV[4])
    a = a + 1 + 2 * n
end
redis.call('LPUSH', KEYS[1], ARGV[1])
return 1
"""

# A delivery either finds the final outcome (a redelivered job that already finished),
# or finds the job running on a live worker (a duplicate delivery: a visibility-timeout
# restore, a peer wrongly thought dead), or becomes the next attempt, learning in the
# same round trip whether the job (or its batch: KEYS[3]) was cancelled while queued.
# A worker is live while its heartbeat key exists; for this same worker the caller
# says (ARGV[4]) whether this process is running the job (a restarted worker with the
# same id is not).
BEGIN = """
local final = redis.call('HGET', KEYS[1], 'final')
if final then
    local field = 'result'
    if final == 'failed' then field = 'error' end
    return {0, 0, final, redis.call('HGET', KEYS[1], field)}
end
local state = redis.call('HMGET', KEYS[1], 'status', 'worker')
if state[1] == 'running' and state[2] then
    if state[2] == ARGV[1] then
        if ARGV[4] == '1' then return {-1, state[2]} end
    elseif redis.call('EXISTS', ARGV[5] .. state[2]) == 1 then
        return {-1, state[2]}
    end
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'started_at', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {attempt, redis.call('EXISTS', KEYS[2], KEYS[3])}
"""

# HSETNX decides who finishes; the rest of the write happens in the same script, so
# a reader never sees ``final`` without its result. A batch line's record is written
# by the same script (core.store.batch_scripts.RECORD_LINE_FN): no crash can separate the two.
FINISH_FN = """
local function finish_job(jkey, dkey, status, field, payload, now, ttl)
  if redis.call('HSETNX', jkey, 'final', status) == 0 then return 0 end
  redis.call('HSET', jkey, 'status', status, field, payload, 'finished_at', now)
  redis.call('HINCRBY', jkey, 'completions', 1)
  redis.call('EXPIRE', jkey, ttl)
  redis.call('RPUSH', dkey, status)
  redis.call('EXPIRE', dkey, ttl)
  return 1
end
"""

FINISH = FINISH_FN + "return finish_job(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])"

FINISH_WITH_LINE = (
    FINISH_FN
    + RECORD_LINE_FN
    + """
if finish_job(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]) == 0 then return 0 end
record_line(KEYS[3], KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], '1', ARGV[4])
return 1
"""
)
