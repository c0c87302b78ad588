-- LockingKit (Redis): take a place in a semaphore.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}:semaphore        the holders: holder id -> expiry (Unix ms)
-- KEYS[2]  <prefix>:{<tag>}:semaphore:fence  the semaphore's fencing counter
-- ARGV[1]  a holder id: any string unique to this hold
-- ARGV[2]  the lease, in whole milliseconds
-- ARGV[3]  the semaphore's count, 1 to 1024: every process must give the same
-- Returns  the fencing token (an integer, at least 1), or 0 when ARGV[3] live holders are
--          there. Expired holders are removed first; the set expires with its longest-lived
--          member.
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
local function hold(set, member, until_ms, lease)
  redis.call('ZADD', set, until_ms, member)
  if redis.call('PTTL', set) < tonumber(lease) then redis.call('PEXPIRE', set, lease) end
end
local t = redis.call('TIME')
local now = now_ms(t)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
local token = mint(KEYS[2], t)
hold(KEYS[1], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return token
