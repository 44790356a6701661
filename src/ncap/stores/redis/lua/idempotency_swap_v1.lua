-- Replace the Idempotency-Key record KEYS[1] only if it still is ARGV[1] (the
-- claimer's own): by ARGV[2] for ARGV[3] ms, or delete it when ARGV[2] is empty.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
