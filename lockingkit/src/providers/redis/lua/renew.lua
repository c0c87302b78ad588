-- LockingKit (Redis): renew an exclusive hold.
--
-- Names: <prefix>:{<tag>} is the lock name of a key, braces included: lockingkit:{orders/42}
-- for the key orders/42 under the default prefix (docs/redis.md, "Key layout").
--
-- KEYS[1]  <prefix>:{<tag>}  the lock
-- ARGV[1]  the holder id it was taken under
-- ARGV[2]  the lease, in whole milliseconds, from now
-- Returns  1 when extended, 0 when the lock is gone or another holder's (nothing is changed).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
