-- ncap budget script, version 3 (key schema "b1", the same keys and hold records as
-- versions 1 and 2). Version 3 adds the generation marker ":g": every operation on a
-- workload's counters first checks that it exists, and refuses with the error
-- "NCAPLOST" when it does not (the counters were lost: a restart without persistence,
-- a FLUSHALL, a failover to an empty replica, an eviction). The gateway then rebuilds
-- them from the ledger and writes them, holds and marker together, with "restore".
-- Gateways still on version 2 do not check the marker: upgrade them all together.
-- Loaded once by SHA (EVALSHA;
-- reloaded on NOSCRIPT). Only bucket arithmetic lives here: the caller
-- decides policy and turns a refusal's counters into the right error.
--
-- KEYS[1] = "<prefix>:b1:{<workload tag>}": every key this script touches starts
-- with it, so all of a workload's keys share one hash slot (Redis Cluster ready).
-- Keys derived from KEYS[1]:
--   :tm:<minute> :rm:<minute>   tokens / requests in a UTC minute (expire 120 s)
--   :td:<day>    :cd:<day>      tokens / micro-USD in a UTC day (expire 2 days)
--   :cm:<month>                 micro-USD in a calendar month (expire 35 days)
--   :x:<exception>              micro-USD over an exception's life
--   :f                          active (in-flight) holds
--   :h                          hold id -> JSON record
--   :i:<instance>               ids of that gateway's active holds (for recovery)
--   :g                          generation marker: present while the counters are whole
-- Time is the server's (TIME) unless the caller passes one (tests).
--
-- Version 2 does what version 1 did with fewer commands (each redis.call costs the
-- server about a microsecond beyond the command itself): the counters are read with
-- one MGET, the hold is claimed with HSETNX (given back with HDEL on a refusal)
-- instead of HEXISTS then HSET, a window key gets its EXPIRE when INCRBY created it
-- (its TTL now runs from the bucket's first reservation, not its latest), and a
-- settlement or release skips the counters it would change by zero.
local base = KEYS[1]
local op = ARGV[1]

-- every operation but "restore" and "recover" needs whole counters
if op ~= 'restore' and op ~= 'recover' and redis.call('EXISTS', base .. ':g') == 0 then
  return redis.error_reply('NCAPLOST budget counters lost; rebuilding from the ledger')
end

local function fmt(n) return string.format('%d', n) end

local function now_us(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- days since 1970-01-01 -> year * 12 + (month - 1)   (H. Hinnant's civil_from_days)
local function month_index(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y * 12 + m - 1
end

local function buckets(us)
  local s = math.floor(us / 1000000)
  local day = math.floor(s / 86400)
  return math.floor(s / 60), day, month_index(day)
end

local function counter_keys(m, d, mo, exc)
  local keys = {
    tm = base .. ':tm:' .. fmt(m), rm = base .. ':rm:' .. fmt(m),
    td = base .. ':td:' .. fmt(d), cd = base .. ':cd:' .. fmt(d),
    cm = base .. ':cm:' .. fmt(mo),
  }
  if exc ~= nil and exc ~= '' then keys.cx = base .. ':x:' .. exc end
  return keys
end

local function num(value) return tonumber(value or '0') end  -- MGET: false if missing

-- the counters a reservation is checked against, and the active holds: one MGET
local function snapshot(keys)
  local v
  if keys.cx == nil then
    v = redis.call('MGET', keys.tm, keys.rm, keys.td, keys.cd, keys.cm, base .. ':f')
  else
    v = redis.call('MGET', keys.tm, keys.rm, keys.td, keys.cd, keys.cm, base .. ':f', keys.cx)
  end
  return { num(v[1]), num(v[2]), num(v[3]), num(v[4]), num(v[5]), num(v[7]), num(v[6]) }
end

local function over(limit, used, add)
  return limit >= 0 and used + add > limit
end

local TTL = { tm = 120, rm = 120, td = 172800, cd = 172800, cm = 3024000 }

-- a reservation adds to every counter, creating it (with its TTL) if missing; INCRBY
-- returning the amount itself means the key is new (or was at 0): it gets its EXPIRE
local function add_new(keys, tokens, cost)
  local amounts = { tm = tokens, rm = 1, td = tokens, cd = cost, cm = cost, cx = cost }
  for name, key in pairs(keys) do
    local amount = amounts[name]
    if redis.call('INCRBY', key, fmt(amount)) == amount and TTL[name] then
      redis.call('EXPIRE', key, TTL[name])
    end
  end
end

-- a settlement changes the counters that still exist (it never revives a bucket that
-- already expired); a change of zero is no change
local function adjust(keys, tokens, cost, requests)
  local amounts = { tm = tokens, rm = requests, td = tokens, cd = cost, cm = cost, cx = cost }
  local list, by = {}, {}
  for name, key in pairs(keys) do
    if amounts[name] ~= 0 then
      list[#list + 1] = key
      by[#by + 1] = amounts[name]
    end
  end
  if #list == 0 then return end
  local found = redis.call('MGET', unpack(list))
  for i, key in ipairs(list) do
    if found[i] then redis.call('INCRBY', key, fmt(by[i])) end
  end
end

local function hold_keys(rec)
  return counter_keys(rec.m, rec.d, rec.mo, rec.x)
end

local function deactivate(rec, id)
  if rec.s == 'active' then
    redis.call('DECR', base .. ':f')
    redis.call('SREM', base .. ':i:' .. rec.g, id)
  end
end

if op == 'reserve' then
  -- ARGV: op, now, hold_id, exception, instance, tokens, cost,
  --       tpm, rpm, tpd, usd_day, usd_month, max_concurrency, exception_budget (-1: none),
  --       workload id
  local us = now_us(ARGV[2])
  local id, exc, inst = ARGV[3], ARGV[4], ARGV[5]
  local tokens, cost = tonumber(ARGV[6]), tonumber(ARGV[7])
  local tpm, rpm, tpd = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  local ud, um, mc, xb = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]),
    tonumber(ARGV[14])
  local m, d, mo = buckets(us)
  local rec = { w = ARGV[15], x = exc, t = tokens, c = cost, m = m, d = d, mo = mo,
                g = inst, at = fmt(us), s = 'active' }
  if redis.call('HSETNX', base .. ':h', id, cjson.encode(rec)) == 0 then
    return { -1, fmt(us) }
  end
  local keys = counter_keys(m, d, mo, exc)
  local u = snapshot(keys)
  local refused = (keys.cx ~= nil and over(xb, u[6], cost)) or over(um, u[5], cost)
    or over(ud, u[4], cost) or over(tpd, u[3], tokens) or (tpm >= 0 and tokens > tpm)
    or over(tpm, u[1], tokens) or over(rpm, u[2], 1) or over(mc, u[7], 1)
  if refused then
    redis.call('HDEL', base .. ':h', id)
    return { 0, fmt(us), u[1], u[2], u[3], u[4], u[5], u[6], u[7] }
  end
  add_new(keys, tokens, cost)
  redis.call('INCR', base .. ':f')
  redis.call('SADD', base .. ':i:' .. inst, id)
  return { 1, fmt(us) }
end

if op == 'usage' then
  -- ARGV: op, now, exception
  local us = now_us(ARGV[2])
  local m, d, mo = buckets(us)
  local u = snapshot(counter_keys(m, d, mo, ARGV[3]))
  return { fmt(us), u[1], u[2], u[3], u[4], u[5], u[6], u[7] }
end

if op == 'settle' or op == 'release' then
  -- ARGV: op, hold_id, actual tokens, actual cost (settle only)
  local id = ARGV[2]
  local raw = redis.call('HGET', base .. ':h', id)
  if not raw then return 0 end
  local rec = cjson.decode(raw)
  if op == 'settle' then
    adjust(hold_keys(rec), tonumber(ARGV[3]) - rec.t, tonumber(ARGV[4]) - rec.c, 0)
  else
    adjust(hold_keys(rec), -rec.t, -rec.c, -1)
  end
  deactivate(rec, id)
  redis.call('HDEL', base .. ':h', id)
  return 1
end

if op == 'keep' then
  local id = ARGV[2]
  local raw = redis.call('HGET', base .. ':h', id)
  if not raw then return 0 end
  local rec = cjson.decode(raw)
  if rec.s ~= 'active' then return 0 end
  deactivate(rec, id)
  rec.s = 'kept'
  redis.call('HSET', base .. ':h', id, cjson.encode(rec))
  return 1
end

if op == 'recover' then
  -- ARGV: op, instance ('' : every instance). Active holds become kept (slot freed,
  -- amounts still counted); returns how many.
  local inst = ARGV[2]
  local ids
  if inst ~= '' then
    ids = redis.call('SMEMBERS', base .. ':i:' .. inst)
  else
    ids = redis.call('HKEYS', base .. ':h')
  end
  local count = 0
  for _, id in ipairs(ids) do
    local raw = redis.call('HGET', base .. ':h', id)
    if raw then
      local rec = cjson.decode(raw)
      if rec.s == 'active' then
        deactivate(rec, id)
        rec.s = 'kept'
        redis.call('HSET', base .. ':h', id, cjson.encode(rec))
        count = count + 1
      end
    end
  end
  if inst ~= '' then redis.call('DEL', base .. ':i:' .. inst) end
  return count
end

if op == 'restore' then
  -- ARGV: op, generation, JSON {c = {key suffix: {amount, ttl}}, h = {hold id: record}}.
  -- Writes counters rebuilt from the ledger, their holds and the marker at once;
  -- a no-op (0) when the marker is back already (another gateway rebuilt them).
  if redis.call('EXISTS', base .. ':g') == 1 then return 0 end
  local data = cjson.decode(ARGV[3])
  for suffix, entry in pairs(data.c) do
    local key = base .. suffix
    redis.call('SET', key, fmt(entry[1]))
    if entry[2] > 0 then redis.call('EXPIRE', key, entry[2]) end
  end
  redis.call('DEL', base .. ':h', base .. ':f')
  local active = 0
  for id, rec in pairs(data.h) do
    redis.call('HSET', base .. ':h', id, cjson.encode(rec))
    if rec.s == 'active' then
      active = active + 1
      redis.call('SADD', base .. ':i:' .. rec.g, id)
    end
  end
  if active > 0 then redis.call('SET', base .. ':f', fmt(active)) end
  redis.call('SET', base .. ':g', ARGV[2])
  return 1
end

return redis.error_reply('ncap budgets_v3: unknown op ' .. tostring(op))
