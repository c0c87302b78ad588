-- LockingKit (Redis): release an exclusive hold, and wake the key's waiters.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}           the lock
-- ARGV[1]  the holder id it was taken under
-- ARGV[2]  <prefix>:{<tag>}:released  the key's release channel
-- Returns  1 when deleted, 0 when the lock was gone or another holder's (then nothing is
--          deleted or published).
-- Publishes the message 'released' on ARGV[2]. Best effort (redis.pcall): a user that may not
-- publish on the channel still releases.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.pcall('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
