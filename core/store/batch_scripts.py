"""The Lua scripts of the batch store (core.store.batchstore): each one Redis runs
whole, so a line's record, its counts and the batch's end cannot come apart.

Where the last line's record ends a batch, its staged input (``<batch key>:lines``,
core.store.keys.batch_lines) is deleted in the same script: the results are the line
records, and nothing sends an ended batch's lines again (kept, it was a second copy of the
input in Redis until the purge). A batch that expires or is cancelled first records its
unrun lines from it, then drops it (BatchStore.drop_staged).
"""

# Lua, shared with core.store.jobstore's finish script. ``fed`` is 1 for a line that was
# handed to the queue (it counts against the feeder's window until it is recorded).
RECORD_LINE_FN = """
local function record_line(bkey, okey, akey, batch_id, line, rec, kind, tokens, ptokens, fed, now)
  if redis.call('EXISTS', bkey) == 0 then return 0 end
  if redis.call('HSETNX', okey, line, rec) == 0 then return 0 end
  if redis.call('TTL', okey) < 0 then redis.call('EXPIREAT', okey, redis.call('HGET', bkey, 'purge_at')) end
  redis.call('HINCRBY', bkey, kind, 1)
  if fed == '1' then redis.call('HINCRBY', bkey, 'fed_done', 1) end
  if tonumber(tokens) > 0 then redis.call('HINCRBY', bkey, 'completion_tokens', tokens) end
  if tonumber(ptokens) > 0 then redis.call('HINCRBY', bkey, 'prompt_tokens', ptokens) end
  local done = redis.call('HINCRBY', bkey, 'done', 1)
  if done == tonumber(redis.call('HGET', bkey, 'total') or '-1') then
    local status = redis.call('HGET', bkey, 'status')
    local final = nil
    if status == 'in_progress' then final = 'completed' elseif status == 'cancelling' then final = 'cancelled' end
    if final then
      redis.call('HSET', bkey, 'status', final, final .. '_at', now)
      redis.call('ZREM', akey, batch_id)
      redis.call('DEL', bkey .. ':lines')
    end
  end
  return 1
end
"""

RECORD_LINE = (
    RECORD_LINE_FN
    + """
return record_line(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
"""
)

# Validation is over: the batch runs (or, with no valid line, fails with the reason).
# A batch cancelled while it was validated stays cancelling; one whose every line is
# already recorded ends here.
END_VALIDATION = """
local bkey, akey, batch_id = KEYS[1], KEYS[2], ARGV[1]
local staged = tonumber(redis.call('HGET', bkey, 'staged') or '0')
local total = tonumber(ARGV[2])
redis.call('HSET', bkey, 'total', total)
local status = redis.call('HGET', bkey, 'status')
if status == 'validating' then
  if staged == 0 then
    redis.call('HSET', bkey, 'status', 'failed', 'failed_at', ARGV[3], 'errors', ARGV[4])
    redis.call('ZREM', akey, batch_id)
      redis.call('DEL', bkey .. ':lines')
    return 'failed'
  end
  redis.call('HSET', bkey, 'status', 'in_progress', 'in_progress_at', ARGV[3])
  return 'in_progress'
end
if status == 'cancelling' and tonumber(redis.call('HGET', bkey, 'done') or '0') == total then
  redis.call('HSET', bkey, 'status', 'cancelled', 'cancelled_at', ARGV[3])
  redis.call('ZREM', akey, batch_id)
      redis.call('DEL', bkey .. ':lines')
  return 'cancelled'
end
return status
"""

# Move the batch to a new status unless it has already ended (or is not in ``from``).
TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[2] .. '_at', ARGV[3])
    if ARGV[2] == 'failed' or ARGV[2] == 'completed' or ARGV[2] == 'expired' or ARGV[2] == 'cancelled' then
      redis.call('ZREM', KEYS[2], ARGV[1])
    end
    return ARGV[2]
  end
end
return status
"""

# The feed cursor only moves forward, so two feeders (a lease that lapsed mid-step)
# cannot move it back and feed a chunk twice.
ADVANCE = """
local fed = tonumber(redis.call('HGET', KEYS[1], 'fed') or '0')
if tonumber(ARGV[1]) > fed then redis.call('HSET', KEYS[1], 'fed', ARGV[1]) end
return redis.call('HGET', KEYS[1], 'fed')
"""

# Create an owned batch only if its owner has fewer than ARGV[5] active (0: no limit):
# the check and the create in one step, so concurrent creates cannot exceed the limit.
# KEYS: the batch, all batches, active batches, purges, the owner's batches.
# ARGV: batch id, now, purge_at, purge member, limit, then the record's field/value pairs.
CREATE_OWNED = """
local limit = tonumber(ARGV[5])
if limit > 0 and redis.call('ZINTERCARD', 2, KEYS[5], KEYS[3]) >= limit then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('EXPIREAT', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('EXPIREAT', KEYS[5], ARGV[3], 'GT')
redis.call('EXPIREAT', KEYS[5], ARGV[3], 'NX')
return 1
"""
