-- Part 3 of the pool ledger script (parts are joined in order; see storage.lua).

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
