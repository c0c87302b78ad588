-- LockingKit (Redis): renew a reader or a semaphore holder.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}:readers, or <prefix>:{<tag>}:semaphore
-- ARGV[1]  the holder id it was taken under
-- ARGV[2]  the lease, in whole milliseconds, from now
-- Returns  1 when extended, 0 when the member is gone or had expired (an expired member is
--          removed).
local function now_ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
local function hold(set, member, until_ms, lease)
  redis.call('ZADD', set, until_ms, member)
  if redis.call('PTTL', set) < tonumber(lease) then redis.call('PEXPIRE', set, lease) end
end
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
local t = redis.call('TIME')
local now = now_ms(t)
if tonumber(score) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
hold(KEYS[1], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return 1
