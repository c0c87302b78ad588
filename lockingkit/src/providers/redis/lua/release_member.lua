-- LockingKit (Redis): release a reader or a semaphore holder.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}:readers, or <prefix>:{<tag>}:semaphore
-- ARGV[1]  the holder id it was taken under
-- ARGV[2]  for a reader, <prefix>:{<tag>}:released, the key's release channel; for a semaphore
--          holder, the empty string (nothing is published)
-- Returns  1 when a live member was removed, 0 when it was gone or had expired.
-- Publishes the message 'released' on ARGV[2] whenever the member was there, best effort
-- (redis.pcall), as the exclusive release does.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.pcall('PUBLISH', ARGV[2], 'released') end
local t = redis.call('TIME')
if tonumber(score) <= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then return 0 end
return 1
