-- tokenpools: one pool's ledger in Redis. A line-for-line port of state/memory.py, so that the
-- same events give the same decisions (tests/test_redis_store.py checks it).
--
-- KEYS[1] is the pool's hash, "<prefix>:{<pool>}". Every other key of the pool is that name
-- plus a suffix, so the hash tag keeps the whole pool on one Redis Cluster shard:
--   P           hash   pool counters, both buckets, epoch, last update period, booking sequence
--   P:e:<name>  hash   one entitlement: own bucket, counters, usage window, scores
--   P:l:<id>    hash   one lease
--   P:exp       zset   lease id -> expires_at
--   P:pre       zset   preemptible lease id -> booking sequence (oldest first)
--   P:inf       hash   entitlement -> its shared-path leases in flight (check 5's competitors)
--   P:low       zset   entitlement in flight -> priority (the threshold is its lowest other)
--   P:ref       zset   entitlement -> priority when last refused room
--   P:reft      hash   entitlement -> when last refused room
--   P:prot      set    entitlements holding a reserved baseline
-- ARGV[1] is the operation, ARGV[2] the epoch the caller last saw. A pool created anew (Redis
-- lost its data) gets a new epoch, and a caller with the old one is told so, to book again the
-- leases it still holds. Numbers are stored with 17 significant digits: a float survives the
-- round trip exactly, and numbers go back to Python as strings (Lua numbers would be truncated).

local P = KEYS[1]
local op = ARGV[1]
local INF = 1 / 0
local STRINGS = { ent = true, epoch = true }

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
  'b_rate', 'b_depth', 'b_level', 'b_t', 'pb_rate', 'pb_depth', 'pb_level', 'pb_t' }
local ENT_FIELDS = { 'conc', 'kv', 'leases', 'protected', 'base_c', 'base_k', 'hold_c', 'hold_k',
  'o_rate', 'o_depth', 'o_level', 'o_t', 't_acc', 'conc_s', 'kv_s', 'settled', 'demand',
  'admitted', 'window_start' }
local LEASE_FIELDS = { 'ent', 'tokens', 'kv', 'started', 'expires', 'pre', 'reserved', 'own' }

local function ent_key(name) return P .. ':e:' .. name end
local function lease_key(id) return P .. ':l:' .. id end

-- buckets: fields <b>rate, <b>depth, <b>level, <b>t of a pool or entitlement table

local function refill(t, b, now)
  local dt = now - t[b .. 't']
  if dt > 0 then
    t[b .. 't'] = now
    local level = t[b .. 'level'] + t[b .. 'rate'] * dt
    if level < t[b .. 'depth'] then t[b .. 'level'] = level else t[b .. 'level'] = t[b .. 'depth'] end
  end
end

local function reshape(t, b, rate, depth, now)
  refill(t, b, now)
  local grown = depth - t[b .. 'depth']
  t[b .. 'rate'], t[b .. 'depth'] = rate, depth
  if grown > 0 and grown ~= INF then t[b .. 'level'] = t[b .. 'level'] + grown end
  if depth < t[b .. 'level'] then t[b .. 'level'] = depth end
end

local function credit(t, b, tokens, now)
  refill(t, b, now)
  local level = t[b .. 'level'] + tokens
  if level < t[b .. 'depth'] then t[b .. 'level'] = level else t[b .. 'level'] = t[b .. 'depth'] end
end

local function new_bucket(t, b, rate, depth, now)
  t[b .. 'rate'], t[b .. 'depth'], t[b .. 'level'], t[b .. 't'] = rate, depth, depth, now
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

local function resync_protected_bucket(p, now)
  local total = 0.0
  for _, name in ipairs(redis.call('SMEMBERS', P .. ':prot')) do
    local key = ent_key(name)
    local e = load(key)
    refill(e, 'o_', now)
    save(key, e, { 'o_level', 'o_t' })
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

-- leases

local function lease_reply(id, l)
  return { id, l.ent, fmt(l.tokens), fmt(l.kv), fmt(l.started), fmt(l.expires), fmt(l.pre),
    fmt(l.reserved), fmt(l.own) }
end

local function book(id, l, e, p, now)
  accumulate(e, now)
  e.conc = e.conc + 1
  e.kv = e.kv + l.kv
  e.leases = e.leases + 1
  p.conc = p.conc + 1
  p.kv = p.kv + l.kv
  p.leases = p.leases + 1
  if l.pre == 1 then
    p.pre_c = p.pre_c + 1
    p.pre_k = p.pre_k + l.kv
    redis.call('ZADD', P .. ':pre', redis.call('HINCRBY', P, 'seq', 1), id)
  end
  if e.protected == 1 then update_holdback(e, p) end
  if l.reserved == 0 then
    if redis.call('HINCRBY', P .. ':inf', l.ent, 1) == 1 then
      redis.call('ZADD', P .. ':low', fmt(e.priority), l.ent)
    end
  end
  save(lease_key(id), l, LEASE_FIELDS)
  redis.call('ZADD', P .. ':exp', fmt(l.expires), id)
end

-- End a lease: `used` tokens of its reservation are spent, the rest goes back to its buckets.
local function finish(id, l, e, p, now, used, observed)
  redis.call('DEL', lease_key(id))
  redis.call('ZREM', P .. ':exp', id)
  accumulate(e, now)
  e.conc = e.conc - 1
  e.kv = e.kv - l.kv
  e.leases = e.leases - 1
  e.settled = e.settled + observed
  p.conc = p.conc - 1
  p.kv = p.kv - l.kv
  p.leases = p.leases - 1
  if l.pre == 1 then
    p.pre_c = p.pre_c - 1
    p.pre_k = p.pre_k - l.kv
    redis.call('ZREM', P .. ':pre', id)
  end
  if e.protected == 1 then update_holdback(e, p) end
  if l.reserved == 0 then
    if redis.call('HINCRBY', P .. ':inf', l.ent, -1) <= 0 then
      redis.call('HDEL', P .. ':inf', l.ent)
      redis.call('ZREM', P .. ':low', l.ent)
    end
  end
  local refund = l.tokens - used
  if refund ~= 0 then
    credit(p, 'b_', refund, now)
    if l.own == 1 then credit(e, 'o_', refund, now) end
    if l.reserved == 1 then credit(p, 'pb_', refund, now) end
  end
end

-- End lease `id` if it exists, saving what it touched; returns the lease or nil.
local function finish_one(id, p, now, used_all, used, observed)
  local l = load(lease_key(id))
  if l == nil then return nil end
  local key = ent_key(l.ent)
  local e = load(key)
  if used_all then used = l.tokens end
  finish(id, l, e, p, now, used, observed)
  save(key, e, ENT_FIELDS)
  return l
end

-- check 5

local function refused(name, priority, now)
  redis.call('ZADD', P .. ':ref', fmt(priority), name)
  redis.call('HSET', P .. ':reft', name, fmt(now))
end

-- The highest priority among other entitlements refused room since `since`; stale entries
-- found on the way are dropped.
local function top_refused(name, since)
  local start = 0
  while true do
    local batch = redis.call('ZREVRANGE', P .. ':ref', start, start + 7, 'WITHSCORES')
    if #batch == 0 then return nil end
    for i = 1, #batch, 2 do
      local other = batch[i]
      if other ~= name then
        local t = tonumber(redis.call('HGET', P .. ':reft', other))
        if t == nil or t < since then
          redis.call('ZREM', P .. ':ref', other)
          redis.call('HDEL', P .. ':reft', other)
          start = start - 1
        else
          return tonumber(batch[i + 1])
        end
      end
    end
    start = start + 8
  end
end

-- The lowest priority among other entitlements' shared-path leases in flight.
local function threshold(name)
  local low = redis.call('ZRANGE', P .. ':low', 0, 1, 'WITHSCORES')
  for i = 1, #low, 2 do
    if low[i] ~= name then return tonumber(low[i + 1]) end
  end
  return -INF
end

local function outranked(name, priority, since)
  local top = top_refused(name, since)
  if top == nil or top <= priority then return false end
  return priority < threshold(name)
end

-- operations

local function pool_counters(p)
  return { fmt(p.conc), fmt(p.kv), fmt(p.pre_c), fmt(p.pre_k), fmt(p.hold_c), fmt(p.hold_k),
    fmt(p.b_level), fmt(p.pb_level), fmt(p.leases) }
end

local function ent_counters(e)
  return { fmt(e.conc), fmt(e.kv), fmt(e.o_level), fmt(e.leases) }
end

local function reserve(p, now)
  -- ARGV: op, epoch, now, id, ent, tokens, kv, started, expires, pre, overcommit, demand,
  --       21 plan numbers, victim ids...
  local id, name = ARGV[4], ARGV[5]
  local tokens, kv = tonumber(ARGV[6]), tonumber(ARGV[7])
  local overcommit, demand = ARGV[11] == '1', tonumber(ARGV[12])
  local plan = {}
  for i = 1, 21 do plan[i] = tonumber(ARGV[12 + i]) end
  local ent_c, ent_k, own_required, base_c, base_k = plan[1], plan[2], plan[3] == 1, plan[4], plan[5]
  local res_c, res_k, res_f, oc_c, oc_k, oc_f = plan[6], plan[7], plan[8], plan[9], plan[10], plan[11]
  local sh_c, sh_k, np_c, np_k, sh_f, np_f = plan[12], plan[13], plan[14], plan[15], plan[16], plan[17]
  local ct_c, ct_k, ct_b, window = plan[18], plan[19], plan[20], plan[21]

  local ekey = ent_key(name)
  local e = load(ekey)
  if e == nil then return redis.error_reply('TPUNKNOWN entitlement ' .. name) end
  if redis.call('EXISTS', lease_key(id)) == 1 then -- a retried call that had succeeded
    local done = load(lease_key(id))
    return { 'ok', fmt(done.reserved), fmt(done.own) }
  end
  e.demand = e.demand + demand
  local used_c, used_k, pre_c, pre_k = p.conc, p.kv, p.pre_c, p.pre_k
  local victims = {}
  for i = 34, #ARGV do
    local v = load(lease_key(ARGV[i]))
    if v ~= nil and v.pre == 1 then
      victims[#victims + 1] = { ARGV[i], v }
      used_c = used_c - 1
      pre_c = pre_c - 1
      used_k = used_k - v.kv
      pre_k = pre_k - v.kv
    end
  end
  -- A refusal answers with the counters the caller reads next (Retry-After, victims), read
  -- as the memory store's pool_counters and entitlement_counters would: one round trip.
  local function refuse(short, contended)
    if contended then refused(name, e.priority, now) end
    refill(e, 'o_', now)
    refill(p, 'b_', now)
    refill(p, 'pb_', now)
    save(ekey, e, ENT_FIELDS)
    save(P, p, POOL_FIELDS)
    return { short, pool_counters(p), ent_counters(e) }
  end
  local conc_after = e.conc + 1
  if conc_after > ent_c then return refuse('entitlement_concurrency', false) end
  refill(e, 'o_', now)
  local own_ok = e.o_level >= tokens
  if own_required and not own_ok then return refuse('entitlement_throughput', false) end
  local kv_after = e.kv + kv
  if kv_after > ent_k then return refuse('entitlement_kv', false) end
  refill(p, 'b_', now)
  refill(p, 'pb_', now)

  local l = { ent = name, tokens = tokens, kv = kv, started = tonumber(ARGV[8]),
    expires = tonumber(ARGV[9]), pre = tonumber(ARGV[10]), reserved = 0, own = 0 }
  if own_ok and conc_after <= base_c and kv_after <= base_k then
    local lc, lk, lf = res_c, res_k, res_f
    if overcommit then lc, lk, lf = oc_c, oc_k, oc_f end
    if used_c + 1 > lc then return refuse('pool_concurrency', true) end
    if used_k + kv > lk then return refuse('pool_kv', true) end
    if p.b_level - tokens < lf then return refuse('pool_throughput', true) end
    e.o_level = e.o_level - tokens
    p.pb_level = p.pb_level - tokens
    l.reserved, l.own = 1, 1
  else
    local hold_c, hold_k = p.hold_c, p.hold_k
    local unreserved = p.b_level - p.pb_level - tokens
    if (used_c + hold_c + 1 > ct_c or used_k + hold_k + kv > ct_k or unreserved < ct_b)
        and outranked(name, e.priority, now - window) then
      return refuse('low_priority', true)
    end
    if used_c - pre_c + hold_c + 1 > np_c then return refuse('reserved_concurrency', true) end
    if used_k - pre_k + hold_k + kv > np_k then return refuse('reserved_kv', true) end
    if unreserved < np_f then return refuse('reserved_throughput', true) end
    if used_c + 1 > sh_c then return refuse('pool_concurrency', true) end
    if used_k + kv > sh_k then return refuse('pool_kv', true) end
    if p.b_level - tokens < sh_f then return refuse('pool_throughput', true) end
    if own_required then
      e.o_level = e.o_level - tokens
      l.own = 1
    end
  end
  for _, victim in ipairs(victims) do
    local vid, v = victim[1], victim[2]
    if v.ent == name then
      finish(vid, v, e, p, now, v.tokens, 0.0)
    else
      local vkey = ent_key(v.ent)
      local ve = load(vkey)
      finish(vid, v, ve, p, now, v.tokens, 0.0)
      save(vkey, ve, ENT_FIELDS)
    end
  end
  p.b_level = p.b_level - tokens
  e.admitted = e.admitted + tokens
  book(id, l, e, p, now)
  save(ekey, e, ENT_FIELDS)
  save(P, p, POOL_FIELDS)
  return { 'ok', fmt(l.reserved), fmt(l.own) }
end

local function configure_pool(now)
  -- ARGV: op, epoch, now, b_rate, b_depth, pb_rate, pb_depth, new epoch
  local p = load(P)
  if p == nil then
    p = { conc = 0.0, kv = 0.0, pre_c = 0.0, pre_k = 0.0, hold_c = 0.0, hold_k = 0.0, leases = 0 }
    new_bucket(p, 'b_', tonumber(ARGV[4]), tonumber(ARGV[5]), now)
    new_bucket(p, 'pb_', tonumber(ARGV[6]), tonumber(ARGV[7]), now)
    save(P, p, POOL_FIELDS)
    redis.call('HSET', P, 'epoch', ARGV[8], 'last_period', -1, 'seq', 0)
    return ARGV[8]
  end
  reshape(p, 'b_', tonumber(ARGV[4]), tonumber(ARGV[5]), now)
  reshape(p, 'pb_', tonumber(ARGV[6]), tonumber(ARGV[7]), now)
  resync_protected_bucket(p, now)
  save(P, p, POOL_FIELDS)
  return p.epoch
end

local function configure_entitlement(p, now)
  -- ARGV: op, epoch, now, name, o_rate, o_depth, hold_c, hold_k, protected
  local name = ARGV[4]
  local key = ent_key(name)
  local e = load(key)
  if e == nil then
    e = { conc = 0.0, kv = 0.0, leases = 0, hold_c = 0.0, hold_k = 0.0, t_acc = now,
      window_start = now, conc_s = 0.0, kv_s = 0.0, settled = 0.0, demand = 0.0, admitted = 0.0 }
    new_bucket(e, 'o_', tonumber(ARGV[5]), tonumber(ARGV[6]), now)
    redis.call('HSET', key, 'debt', 0, 'burst', 0, 'priority', 0)
  else
    reshape(e, 'o_', tonumber(ARGV[5]), tonumber(ARGV[6]), now)
  end
  e.protected = tonumber(ARGV[9])
  if e.protected == 1 then
    redis.call('SADD', P .. ':prot', name)
  else
    redis.call('SREM', P .. ':prot', name)
  end
  e.base_c, e.base_k = tonumber(ARGV[7]), tonumber(ARGV[8])
  update_holdback(e, p)
  save(key, e, ENT_FIELDS)
  resync_protected_bucket(p, now)
  save(P, p, POOL_FIELDS)
  return 'ok'
end

local function remove_entitlement(p)
  local name = ARGV[4]
  local key = ent_key(name)
  local e = load(key)
  if e == nil then return {} end
  local ended = {}
  for _, id in ipairs(redis.call('ZRANGE', P .. ':exp', 0, -1)) do
    local l = load(lease_key(id))
    if l ~= nil and l.ent == name then
      finish(id, l, e, p, e.t_acc, l.tokens, 0.0)
      ended[#ended + 1] = lease_reply(id, l)
    end
  end
  e.base_c, e.base_k = 0.0, 0.0
  update_holdback(e, p)
  redis.call('SREM', P .. ':prot', name)
  redis.call('ZREM', P .. ':ref', name)
  redis.call('HDEL', P .. ':reft', name)
  redis.call('DEL', key)
  save(P, p, POOL_FIELDS)
  return ended
end

local function adopt(p, now)
  -- Book a lease admitted elsewhere (a replica's local fallback, or a lease Redis lost) with no
  -- checks: the request is running. Charged to the pool bucket; settling refunds the rest.
  -- ARGV: op, epoch, now, id, ent, tokens, kv, started, expires, pre
  local id, name = ARGV[4], ARGV[5]
  if redis.call('EXISTS', lease_key(id)) == 1 then return 0 end
  local ekey = ent_key(name)
  local e = load(ekey)
  if e == nil then return 0 end
  local l = { ent = name, tokens = tonumber(ARGV[6]), kv = tonumber(ARGV[7]),
    started = tonumber(ARGV[8]), expires = tonumber(ARGV[9]), pre = tonumber(ARGV[10]),
    reserved = 0, own = 0 }
  refill(p, 'b_', now)
  p.b_level = p.b_level - l.tokens
  e.admitted = e.admitted + l.tokens
  book(id, l, e, p, now)
  save(ekey, e, ENT_FIELDS)
  save(P, p, POOL_FIELDS)
  return 1
end

local function expire(p, now)
  local ended = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':exp', '-inf', fmt(now))) do
    local l = finish_one(id, p, now, true, 0.0, 0.0)
    if l ~= nil then ended[#ended + 1] = lease_reply(id, l) end
  end
  if #ended > 0 then save(P, p, POOL_FIELDS) end
  return ended
end

local function take_window(now)
  local key = ent_key(ARGV[4])
  local e = load(key)
  accumulate(e, now)
  local reply = { fmt(now - e.window_start), fmt(e.settled), fmt(e.demand), fmt(e.admitted),
    fmt(e.conc_s), fmt(e.kv_s) }
  e.window_start = now
  e.settled, e.demand, e.admitted, e.conc_s, e.kv_s = 0.0, 0.0, 0.0, 0.0, 0.0
  save(key, e, ENT_FIELDS)
  return reply
end

local function set_scores()
  local name = ARGV[4]
  redis.call('HSET', ent_key(name), 'debt', ARGV[5], 'burst', ARGV[6], 'priority', ARGV[7])
  redis.call('ZADD', P .. ':low', 'XX', ARGV[7], name)
  return 'ok'
end

local now = tonumber(ARGV[3])
if op == 'configure_pool' then return configure_pool(now) end
-- the operations that change the pool's counters read its whole hash, epoch included
local p = nil
if op == 'reserve' or op == 'finish' then
  p = load(P)
  if p == nil or p.epoch ~= ARGV[2] then
    return redis.error_reply('TPEPOCH ' .. tostring(p and p.epoch))
  end
else
  local epoch = redis.call('HGET', P, 'epoch')
  if epoch ~= ARGV[2] then return redis.error_reply('TPEPOCH ' .. tostring(epoch)) end
end

if op == 'renew' then
  local key = lease_key(ARGV[4])
  if redis.call('EXISTS', key) == 0 then return 0 end
  redis.call('HSET', key, 'expires', ARGV[5])
  redis.call('ZADD', P .. ':exp', ARGV[5], ARGV[4])
  return 1
end
if op == 'get_lease' then
  local l = load(lease_key(ARGV[4]))
  if l == nil then return nil end
  return lease_reply(ARGV[4], l)
end
if op == 'scores' then
  return redis.call('HMGET', ent_key(ARGV[4]), 'debt', 'burst', 'priority')
end
if op == 'set_scores' then return set_scores() end
if op == 'take_window' then return take_window(now) end
if op == 'entitlement_counters' then
  local key = ent_key(ARGV[4])
  local e = load(key)
  refill(e, 'o_', now)
  save(key, e, { 'o_level', 'o_t' })
  return ent_counters(e)
end
if op == 'claim_update' then
  if tonumber(ARGV[4]) <= tonumber(redis.call('HGET', P, 'last_period')) then return 0 end
  redis.call('HSET', P, 'last_period', ARGV[4])
  return 1
end
if op == 'preemptible' then
  local out = {}
  for _, id in ipairs(redis.call('ZRANGE', P .. ':pre', 0, -1)) do
    local l = load(lease_key(id))
    if l ~= nil then out[#out + 1] = lease_reply(id, l) end
  end
  return out
end

if op == 'reserve' then return reserve(p, now) end
if op == 'finish' then
  -- ARGV: op, epoch, now, id, used ('all' or tokens), observed
  local used_all = ARGV[5] == 'all'
  local l = finish_one(ARGV[4], p, now, used_all, tonumber(ARGV[5]) or 0.0, tonumber(ARGV[6]))
  if l == nil then return nil end
  save(P, p, POOL_FIELDS)
  return lease_reply(ARGV[4], l)
end
p = load(P)
if op == 'configure_entitlement' then return configure_entitlement(p, now) end
if op == 'remove_entitlement' then return remove_entitlement(p) end
if op == 'adopt' then return adopt(p, now) end
if op == 'expire' then return expire(p, now) end
if op == 'pool_counters' then
  refill(p, 'b_', now)
  refill(p, 'pb_', now)
  save(P, p, POOL_FIELDS)
  return pool_counters(p)
end
return redis.error_reply('TPUNKNOWN operation ' .. op)
