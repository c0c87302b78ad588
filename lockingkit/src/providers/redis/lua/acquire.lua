-- LockingKit (Redis): take a lock exclusively, as a writer or a plain lock.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}          the lock: a string holding the holder id
-- KEYS[2]  <prefix>:{<tag>}:readers  the readers: a sorted set, holder id -> expiry (Unix ms)
-- KEYS[3]  <prefix>:{<tag>}:intent   present while a writer waits for readers
-- KEYS[4]  <prefix>:{<tag>}:fence    the key's fencing counter
-- ARGV[1]  a holder id: any string unique to this hold
-- ARGV[2]  the lease, in whole milliseconds
-- ARGV[3]  the writer's intent, in whole milliseconds
-- Returns  the fencing token (an integer, at least 1), or 0 when the lock is held or read.
--          Finding live readers, it sets the intent for ARGV[3] ms, which refuses new readers
--          until it expires or a writer takes the lock.
-- Errors   FENCING when the counter is at 2^53-1: no greater token is exact.
local function now_ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
local function mint(fence, t)
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', fence) or '0') or 0
  if last >= 9007199254740991 then
    error(redis.error_reply('FENCING the fencing counter is at 2^53-1: no greater token is exact'))
  end
  local token = math.max(last + 1, floor)
  redis.call('SET', fence, string.format('%d', token), 'PX', 86400000)
  return token
end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('TIME')
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms(t))
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
    return 0
  end
end
local token = mint(KEYS[4], t)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[3])
return token
