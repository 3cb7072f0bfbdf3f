-- Part 2 of the pool ledger script (parts are joined in order; see storage.lua).

-- budgets and the usage ledger: a port of state/metering.py
--   <budget key>   hash   one budget window's counter: used, held, refused (named by the
--                         caller; in the pool's hash slot when the budget has one pool), and
--                         n:<threshold> once its notice is claimed
--   P:u:<hour>:<b> hash   one hour's usage of one ledger bucket: a field per measure and
--                         count, v its version
--   P:up           zset   "<hour>:<bucket>" not yet written to SQL, scored by when it first
--                         changed after its last acknowledged write (an earlier version kept
--                         a set P:ud: its members join once)

local HOUR = 3600
local LEDGER_TTL = 8 * 24 * 3600  -- a bucket is taken (written to SQL) well before this

-- the lease fields that hold its worst case, by measure
local function worst(l)
  return { input = l.w_in, output = l.w_out, cached = 0.0, tokens = l.tokens, cost = l.w_cost }
end

local function budget_counter(key)
  local c = redis.call('HMGET', key, 'used', 'held')
  return tonumber(c[1]) or 0.0, tonumber(c[2]) or 0.0
end

-- The holds of the admission group starting `o` past the first: {key, measure, limit, until}.
local function read_holds(o)
  local holds = {}
  local at = o + HOLDS_AT
  for _ = 1, tonumber(ARGV[o + A.holds]) do
    holds[#holds + 1] = { ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]) }
    at = at + HOLD_ARGS
  end
  return holds
end

-- The first hold (from 1) whose window cannot take the worst case `w` (marked refused: the
-- window is spent, whatever is left); 0 if all can.
local function budget_refusing(holds, w)
  for i, h in ipairs(holds) do
    local used, held = budget_counter(h[1])
    if used + held + w[h[2]] > h[3] then
      redis.call('HSET', h[1], 'refused', 1)
      if h[4] ~= INF then redis.call('EXPIREAT', h[1], math.ceil(h[4]) + LEDGER_TTL) end
      return i
    end
  end
  return 0
end

local function budget_hold(holds, w)
  for _, h in ipairs(holds) do
    local used, held = budget_counter(h[1])
    redis.call('HSET', h[1], 'used', fmt(used), 'held', fmt(held + w[h[2]]))
    if h[4] ~= INF then redis.call('EXPIREAT', h[1], math.ceil(h[4]) + LEDGER_TTL) end
  end
end

-- What a budget counts of a charge in measure m: at most the reservation (control/store.py
-- counted).
local function counted(charge, w, m)
  local cap = w[m]
  if m == 'cached' then cap = w.input end
  return math.min(charge[m], cap)
end

local function budget_left(holds)
  local left = {}
  for _, h in ipairs(holds) do
    local used, held = budget_counter(h[1])
    left[#left + 1] = fmt(h[3] - (used + held))
  end
  return left
end

local function ledger_add(bucket, now, values)
  local member = string.format('%d', math.floor(now / HOUR) * HOUR) .. ':' .. bucket
  local key = P .. ':u:' .. member
  for f, amount in pairs(values) do
    if amount ~= 0 then redis.call('HINCRBYFLOAT', key, f, fmt(amount)) end
  end
  redis.call('HINCRBY', key, 'v', 1)
  redis.call('EXPIRE', key, LEDGER_TTL)
  redis.call('ZADD', P .. ':up', 'NX', fmt(now), member)
end

local function ledger_refused(bucket, reason, now)
  if bucket ~= nil and bucket ~= '' then ledger_add(bucket, now, { ['refused:' .. reason] = 1 }) end
end

-- A metered lease ended: its holds go, `charge` (nil: its worst case) is used and recorded.
local function meter_end(l, now, charge, how)
  if l.bucket == nil or l.bucket == '' then return end
  local w = worst(l)
  charge = charge or w
  local holds = l.holds or {}
  for i = 1, #holds, 2 do
    local key, m = holds[i], holds[i + 1]
    local used, held = budget_counter(key)
    redis.call('HSET', key, 'held', fmt(held - w[m]), 'used', fmt(used + counted(charge, w, m)))
  end
  local values = { requests = 1, input = charge.input, output = charge.output,
    cached = charge.cached, tokens = charge.tokens, cost = charge.cost,
    over_tokens = math.max(0, charge.tokens - w.tokens),
    over_cost = math.max(0, charge.cost - w.cost) }
  if how == 'evicted' or how == 'expired' then values[how] = 1 end
  ledger_add(l.bucket, now, values)
end

-- A lease that ended on its worst case is charged what it used instead (Store.recharge): each
-- budget gives back budget_refund (never takes more), the ledger records the difference now.
local function recharge(now)
  local function a(i) return tonumber(ARGV[i]) end
  local w = { input = a(A.w_in), output = a(A.w_out), cached = 0.0, tokens = a(A.w_tokens),
    cost = a(A.w_cost) }
  local c = { input = a(A.c_in), output = a(A.c_out), cached = a(A.c_cached),
    tokens = a(A.c_tokens), cost = a(A.c_cost) }
  local at = A.holds + 1
  for _ = 1, a(A.holds) do
    local key, m = ARGV[at], ARGV[at + 1]
    local back = math.max(0, counted(w, w, m) - counted(c, w, m))
    local used = budget_counter(key)
    if back > 0 and redis.call('EXISTS', key) == 1 then
      redis.call('HSET', key, 'used', fmt(math.max(0, used - back)))
      redis.call('HDEL', key, 'refused')  -- given room back: no longer spent
    end
    at = at + 2
  end
  local bucket = ARGV[A.bucket]
  if bucket ~= '' then
    ledger_add(bucket, now, { input = c.input - w.input, output = c.output - w.output,
      cached = c.cached - w.cached, tokens = c.tokens - w.tokens, cost = c.cost - w.cost,
      over_tokens = math.max(0, c.tokens - w.tokens), over_cost = math.max(0, c.cost - w.cost) })
  end
  return 'ok'
end

-- The oldest `limit` pending rows, as {count, oldest, lost, rows}: how many are pending, when
-- the oldest first changed ('' when none), how many had expired unwritten (LEDGER_TTL) and are
-- dropped now, and each row: "<hour>:<bucket>", then field, value pairs. Changes nothing else.
local function pending_usage(limit, now)
  local queue, old = P .. ':up', P .. ':ud'
  if redis.call('EXISTS', old) == 1 then
    for _, member in ipairs(redis.call('SMEMBERS', old)) do
      redis.call('ZADD', queue, 'NX', fmt(now), member)
    end
    redis.call('DEL', old)
  end
  local rows, lost = {}, 0
  local members = redis.call('ZRANGE', queue, 0, limit - 1)
  for _, member in ipairs(members) do
    local values = redis.call('HGETALL', P .. ':u:' .. member)
    if #values == 0 then
      redis.call('ZREM', queue, member)
      lost = lost + 1
    else
      local row = { member }
      for _, v in ipairs(values) do row[#row + 1] = v end
      rows[#rows + 1] = row
    end
  end
  local first = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  return { tostring(redis.call('ZCARD', queue)), first[2] or '', tostring(lost), rows }
end

-- Rows committed to SQL, as member, version pairs from `from` on: each leaves the queue unless
-- it changed since (its version moved on).
local function ack_usage(from)
  for i = from, #ARGV, 2 do
    if redis.call('HGET', P .. ':u:' .. ARGV[i], 'v') == ARGV[i + 1] then
      redis.call('ZREM', P .. ':up', ARGV[i])
    end
  end
  return 'ok'
end
