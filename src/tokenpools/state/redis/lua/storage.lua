-- tokenpools: one pool's ledger in Redis, one script in five parts joined in order (storage,
-- metering, leases, reserve, operations). A line-for-line port of state/memory.py, state/checks.py and
-- state/accounts.py, so that the same events give the same decisions (tests/test_redis_store.py
-- and tests/test_store_differential.py check it).
--
-- KEYS[1] is the pool's hash, "<prefix>:{<pool>}". Every other key of the pool is that name
-- plus a suffix, so the hash tag keeps the whole pool on one Redis Cluster shard:
--   P           hash   pool counters, both buckets, epoch, last update period, booking sequence
--   P:e:<name>  hash   one entitlement: field s its record (own bucket, counters, usage
--                      window; MessagePack), fields debt, burst, priority its scores
--   P:l:<id>    string one lease's record (MessagePack)
--   P:exp       zset   lease id -> expires_at
--   P:pre       zset   preemptible lease id -> booking sequence (oldest first)
--   P:inf       hash   entitlement -> its shared-path leases in flight (check 5's competitors)
--   P:low       zset   entitlement in flight -> priority (the threshold is its lowest other)
--   P:ref       zset   entitlement -> priority when last refused room (RESERVED_ONLY and its
--                      name: refused only the unused baselines' room; leases.lua `refused`)
--   P:reft      hash   the same keys -> when last refused room
--   P:prot      set    entitlements holding a reserved baseline
--   P:alive     hash   replica -> when it last expired leases (its heartbeat)
--   P:o:<name>  set    the leases a replica booked and holds
--   P:gone      zset   lease id given up before its booking was known -> until when refused
-- ARGV[1] is the operation, ARGV[2] the epoch the caller last saw, ARGV[4] the calling replica. A pool created anew (Redis
-- lost its data) gets a new epoch, and a caller with the old one is told so, to book again the
-- leases it still holds. Numbers are stored with 17 significant digits: a float survives the
-- round trip exactly, and numbers go back to Python as strings (Lua numbers would be truncated).

local P = KEYS[1]
local op = ARGV[1]
local OWNER = ARGV[H.owner]
local INF = 1 / 0
local STRINGS = { epoch = true }  -- the pool hash's one field that is not a number

local function fmt(x)
  if type(x) == 'number' then return string.format('%.17g', x) end
  return x
end

-- A loaded hash remembers what it held (t.__o), so that saving writes only what changed.
local function load(key)
  local raw = redis.call('HGETALL', key)
  if #raw == 0 then return nil end
  local t, o = {}, {}
  for i = 1, #raw, 2 do
    local f, v = raw[i], raw[i + 1]
    if not STRINGS[f] then v = tonumber(v) end
    t[f] = v
    o[f] = v
  end
  t.__o = o
  return t
end

local function save(key, t, fields)
  local o = t.__o
  if o == nil then
    o = {}
    t.__o = o
  end
  local args = {}
  for _, f in ipairs(fields) do
    local v = t[f]
    if v ~= o[f] then
      args[#args + 1] = f
      args[#args + 1] = fmt(v)
      o[f] = v
    end
  end
  if #args > 0 then redis.call('HSET', key, unpack(args)) end
end

local POOL_FIELDS = { 'conc', 'kv', 'pre_c', 'pre_k', 'hold_c', 'hold_k', 'leases',
  'b_rate', 'b_depth', 'b_level', 'b_t', 'pb_rate', 'pb_depth', 'pb_level', 'pb_t', 'cl_c', 'cl_k',
  'cl_c2', 'cl_k2', 'recl' }
local ENT_FIELDS = { 'conc', 'kv', 'peak_c', 'peak_k', 'leases', 'protected', 'base_c', 'base_k',
  'hold_c', 'hold_k', 'o_rate', 'o_depth', 'o_level', 'o_t', 't_acc', 'conc_s', 'kv_s', 'settled', 'demand',
  'admitted', 'window_start', 'claim_c', 'claim_k', 'cl_c', 'cl_k' }
local LEASE_FIELDS = { 'ent', 'tokens', 'kv', 'started', 'expires', 'pre', 'reserved', 'own',
  'res', 'owner', 'bucket', 'w_in', 'w_out', 'w_cost', 'holds' }

local function ent_key(name) return P .. ':e:' .. name end
local function lease_key(id) return P .. ':l:' .. id end

-- Entitlements and leases are records: their numbers packed together (MessagePack, exact for
-- every double), read and written whole. Unpacking one costs a few µs; reading the same
-- numbers from hash fields and converting each costs ~4x that, which was most of the script's
-- time per admission. An entitlement's record is field 's' of its hash, next to the scores
-- (debt, burst, priority) the update period writes; a lease's is its own string key.

local function load_ent(key)
  local raw = redis.call('HMGET', key, 's', 'priority')
  if not raw[1] then return nil end
  local e = cmsgpack.unpack(raw[1])
  e.priority = tonumber(raw[2])
  return e
end

local function save_ent(key, e)
  local record = {}
  for _, f in ipairs(ENT_FIELDS) do record[f] = e[f] end
  redis.call('HSET', key, 's', cmsgpack.pack(record))
end

local function load_lease(id)
  local raw = redis.call('GET', lease_key(id))
  if not raw then return nil end
  return cmsgpack.unpack(raw)
end

local function save_lease(id, l)
  local record = {}
  for _, f in ipairs(LEASE_FIELDS) do record[f] = l[f] end
  redis.call('SET', lease_key(id), cmsgpack.pack(record))
end

-- buckets: fields <b>rate, <b>depth, <b>level, <b>t of a pool or entitlement table; their
-- names are made once here (joining strings on every call measured as a cost of its own)
local BUCKET = {}
for _, b in ipairs({ 'b_', 'pb_', 'o_' }) do
  BUCKET[b] = { rate = b .. 'rate', depth = b .. 'depth', level = b .. 'level', t = b .. 't' }
end

local function refill(t, b, now)
  local f = BUCKET[b]
  local dt = now - t[f.t]
  if dt > 0 then
    t[f.t] = now
    local level = t[f.level] + t[f.rate] * dt
    if level < t[f.depth] then t[f.level] = level else t[f.level] = t[f.depth] end
  end
end

local function reshape(t, b, rate, depth, now)
  local f = BUCKET[b]
  refill(t, b, now)
  local grown = depth - t[f.depth]
  t[f.rate], t[f.depth] = rate, depth
  if grown > 0 and grown ~= INF then t[f.level] = t[f.level] + grown end
  if depth < t[f.level] then t[f.level] = depth end
end

local function credit(t, b, tokens, now)
  local f = BUCKET[b]
  refill(t, b, now)
  local level = t[f.level] + tokens
  if level < t[f.depth] then t[f.level] = level else t[f.level] = t[f.depth] end
end

local function new_bucket(t, b, rate, depth, now)
  local f = BUCKET[b]
  t[f.rate], t[f.depth], t[f.level], t[f.t] = rate, depth, depth, now
end

local function max0(x)
  if x > 0 then return x end
  return 0.0
end

local function accumulate(e, now)
  local dt = now - e.t_acc
  if dt > 0 then
    e.conc_s = e.conc_s + e.conc * dt
    e.kv_s = e.kv_s + e.kv * dt
    e.t_acc = now
  end
end

local function update_holdback(e, p)
  local hold_c = max0(e.base_c - e.conc)
  local hold_k = max0(e.base_k - e.kv)
  p.hold_c = p.hold_c + (hold_c - e.hold_c)
  p.hold_k = p.hold_k + (hold_k - e.hold_k)
  e.hold_c, e.hold_k = hold_c, hold_k
end

-- control/backfill.py: the pool keeps Σ max(0, claim − in flight) over its entitlements, and
-- Σ of their squares (records and pools written before claims were kept have none: 0)
local function update_claim(e, p)
  local c = max0((e.claim_c or 0.0) - e.conc)
  local k = max0((e.claim_k or 0.0) - e.kv)
  local old_c, old_k = e.cl_c or 0.0, e.cl_k or 0.0
  p.cl_c = (p.cl_c or 0.0) + (c - old_c)
  p.cl_k = (p.cl_k or 0.0) + (k - old_k)
  p.cl_c2 = (p.cl_c2 or 0.0) + (c * c - old_c * old_c)
  p.cl_k2 = (p.cl_k2 or 0.0) + (k * k - old_k * old_k)
  e.cl_c, e.cl_k = c, k
end

local function open_claims(total, squares)
  local bound = CLAIM_SIGMAS * math.sqrt(max0(squares or 0.0))
  total = total or 0.0
  if bound < total then return bound end
  return total
end

local function resync_protected_bucket(p, now)
  local total = 0.0
  for _, name in ipairs(redis.call('SMEMBERS', P .. ':prot')) do
    local key = ent_key(name)
    local e = load_ent(key)
    refill(e, 'o_', now)
    save_ent(key, e)
    total = total + max0(e.o_level)
  end
  refill(p, 'pb_', now)
  local level = p.pb_level
  if p.pb_depth < level then level = p.pb_depth end
  local floor = total
  if p.pb_depth < floor then floor = p.pb_depth end
  if floor > level then level = floor end
  p.pb_level = level
end
