-- Claim a client's Idempotency-Key: store ARGV[1] under KEYS[1] for ARGV[2] ms
-- unless a record is there; returns the record already there, or false when stored.
local current = redis.call('GET', KEYS[1])
if current then
  return current
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
