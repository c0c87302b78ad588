-- LockingKit (Redis): take a lock shared, as a reader.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}          the lock: a string holding the exclusive holder's id
-- KEYS[2]  <prefix>:{<tag>}:readers  the readers: a sorted set, holder id -> expiry (Unix ms)
-- KEYS[3]  <prefix>:{<tag>}:intent   present while a writer waits for readers
-- KEYS[4]  <prefix>:{<tag>}:fence    the key's fencing counter, shared with the exclusive holders
-- ARGV[1]  a holder id: any string unique to this hold
-- ARGV[2]  the lease, in whole milliseconds
-- Returns  the fencing token (an integer, at least 1), or 0 while the lock is held exclusively
--          or a writer's intent stands. The reader becomes a member of KEYS[2], scored by its
--          expiry; the set expires with its longest-lived member.
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
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local t = redis.call('TIME')
local now = now_ms(t)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local token = mint(KEYS[4], t)
hold(KEYS[2], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return token
