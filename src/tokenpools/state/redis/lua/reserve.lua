-- Part 4 of the pool ledger script (parts are joined in order; see storage.lua).

-- admission: a port of MemoryStore.admit and _reserve, state/checks.py and control/eviction.py

local function counters(t, names)
  local out = {}
  for _, f in ipairs(names) do out[#out + 1] = fmt(t[f] or 0.0) end  -- none: written before it
  return out
end

-- One attempt to book lease `l` of entitlement `e`: nil if it fits (and is booked), else the
-- comparison that failed. `victims` ({id, lease} pairs) count as gone, and end if it fits.
local function attempt(p, e, l, plan, now, overcommit, victims, share)
  local tokens, kv = l.tokens, l.kv
  local used_c, used_k, pre_c, pre_k = p.conc, p.kv, p.pre_c, p.pre_k
  local conc_after = e.conc + 1
  if conc_after > plan.ent_concurrency then return 'entitlement_concurrency' end
  refill(e, 'o_', now)
  local own_ok = e.o_level >= tokens
  if plan.own_required == 1 and not own_ok then return 'entitlement_throughput' end
  local kv_after = e.kv + kv
  if kv_after > plan.ent_kv then return 'entitlement_kv' end
  local within = own_ok and conc_after <= plan.base_concurrency and kv_after <= plan.base_kv
  -- the pool owes a protected request nothing beyond its baseline
  if #victims > 0 and e.protected == 1 and not within then return 'pool_concurrency' end
  refill(p, 'b_', now)
  local level, recl = p.b_level, reclaimable(p)
  for _, victim in ipairs(victims) do
    used_c = used_c - 1
    pre_c = pre_c - 1
    used_k = used_k - victim[2].kv
    pre_k = pre_k - victim[2].kv
    local refund = refund_when_taken(victim[2])
    level = level + refund
    recl = recl - refund
  end
  if level > p.b_depth then level = p.b_depth end
  refill(p, 'pb_', now)
  local name = l.ent
  local function contended(short)
    refused(name, e.priority, now)
    return short
  end

  if within then
    local lc, lk, lf = plan.reserved_concurrency, plan.reserved_kv, plan.reserved_bucket_floor
    if overcommit then
      lc, lk, lf = plan.overcommit_concurrency, plan.overcommit_kv, plan.overcommit_bucket_floor
    end
    if used_c + 1 > lc then return contended('pool_concurrency') end
    if used_k + kv > lk then return contended('pool_kv') end
    if level - tokens < lf then return contended('pool_throughput') end
    e.o_level = e.o_level - tokens
    p.pb_level = p.pb_level - tokens
    l.reserved, l.own = 1, 1
  else
    local hold_c, hold_k = p.hold_c, p.hold_k
    -- beyond the protected share: lent work's tokens are spent in what makes the pool
    -- contended, but the share is kept while lent work would give back what it draws of it
    local spare = level - p.pb_level - tokens
    local unreserved = spare + recl
    if (used_c + hold_c + 1 > plan.contended_concurrency
        or used_k + hold_k + kv > plan.contended_kv
        or spare < plan.contended_bucket)
        and outranked(name, e.priority * plan.priority_margin, now - plan.contention_window_s,
          l.pre == 1) then
      return contended('low_priority')
    end
    -- What is held for protected baselines first: evicting preemptible work cannot help there.
    local short = nil
    if used_c - pre_c + hold_c + 1 > plan.nonpreemptible_concurrency then
      short = 'reserved_concurrency'
    elseif used_k - pre_k + hold_k + kv > plan.nonpreemptible_kv then
      short = 'reserved_kv'
    elseif unreserved < plan.nonpreemptible_bucket_floor then
      short = 'reserved_throughput'
    end
    if short then
      -- Where only the unused baselines stop it, lent work may run there and leave this
      -- request no less: its refusal then counts in check 5 against work not lent only.
      -- Not so for tokens: lent work spends them from the same unreserved allowance.
      local full = short == 'reserved_throughput' or used_c + 1 > plan.shared_concurrency
        or used_k + kv > plan.shared_kv or level - tokens < plan.shared_bucket_floor
      refused(name, e.priority, now, not full)
      return short
    end
    -- surplus work leaves its share of what the others are expected to claim back free
    -- (control/backfill.py's slots_kept and kv_kept: whole sequences, so a fading claim's
    -- fraction of one holds no slot back)
    if plan.surplus == 1 and used_c + math.floor(share * open_claims(p.cl_c, p.cl_c2) + 1e-9)
      + 1 > plan.shared_concurrency then
      return contended('reserved_concurrency')
    end
    if plan.surplus == 1 and used_k + share * open_claims(p.cl_k, p.cl_k2) + kv > plan.shared_kv then
      return contended('reserved_kv')
    end
    if used_c + 1 > plan.shared_concurrency then return contended('pool_concurrency') end
    if used_k + kv > plan.shared_kv then return contended('pool_kv') end
    if level - tokens < plan.shared_bucket_floor then return contended('pool_throughput') end
    if plan.own_required == 1 then
      e.o_level = e.o_level - tokens
      l.own = 1
    end
  end
  for _, victim in ipairs(victims) do
    local vid, v = victim[1], victim[2]
    if v.ent == name then
      finish(vid, v, e, p, now, v.tokens - refund_when_taken(v), 0.0, nil, 'evicted')
    else
      local vkey = ent_key(v.ent)
      local ve = load_ent(vkey)
      finish(vid, v, ve, p, now, v.tokens - refund_when_taken(v), 0.0, nil, 'evicted')
      save_ent(vkey, ve)
    end
  end
  p.b_level = p.b_level - tokens
  e.admitted = e.admitted + tokens
  book(l.id, l, e, p, now)
  return nil
end

-- Preemptible leases of the entitlements in `order` (that order; the newest first within
-- one) until a request of `kv` KV tokens reserving `tokens` fits the pool's shared capacity
-- and token bucket; none if it never would.
local function choose_victims(p, plan, kv, tokens, order, now)
  local need_c = p.conc + 1 - plan.shared_concurrency
  local need_k = p.kv + kv - plan.shared_kv
  if need_c > p.pre_c or need_k > p.pre_k then return {} end
  refill(p, 'b_', now)
  local need_t = tokens - p.b_level + plan.shared_bucket_floor
  if need_t > reclaimable(p) + 1e-6 then return {} end  -- all the lent work gives back too little
  local wanted, groups = {}, {}
  for _, name in ipairs(order) do wanted[name] = true end
  for _, id in ipairs(redis.call('ZREVRANGE', P .. ':pre', 0, -1)) do
    local v = load_lease(id)
    if v ~= nil and wanted[v.ent] then
      local group = groups[v.ent]
      if group == nil then
        group = {}
        groups[v.ent] = group
      end
      group[#group + 1] = { id, v }
    end
  end
  local victims = {}
  for _, name in ipairs(order) do
    for _, victim in ipairs(groups[name] or {}) do
      local refund = refund_when_taken(victim[2])
      local slots_met = need_c <= 0 and need_k <= 0
      if slots_met and need_t <= 0 then return victims end
      -- once only tokens are needed, a lease that gives none back runs on
      if not slots_met or refund > 0 then
        victims[#victims + 1] = victim
        need_c = need_c - 1
        need_k = need_k - victim[2].kv
        need_t = need_t - refund
      end
    end
  end
  if need_c <= 0 and need_k <= 0 and need_t <= 0 then return victims end
  return {}
end

local POOL_SHORTFALLS = { pool_concurrency = true, pool_kv = true, pool_throughput = true }

-- One admission, whose group of arguments starts `o` past the first group's place.
local function admit(p, o)
  local now = tonumber(ARGV[o + A.at])
  local id, name = ARGV[o + A.id], ARGV[o + A.ent]
  local plan = {}
  for i, f in ipairs(PLAN_FIELDS) do plan[f] = tonumber(ARGV[o + PLAN_AT + i - 1]) end
  local order = {}
  local victims_at = o + HOLDS_AT + HOLD_ARGS * tonumber(ARGV[o + A.holds])
  for i = victims_at, o + A.size + tonumber(ARGV[o + A.size]) - 1 do
    order[#order + 1] = ARGV[i]
  end
  local ekey = ent_key(name)
  local e = load_ent(ekey)
  if e == nil then return redis.error_reply('TPUNKNOWN entitlement ' .. name) end
  if redis.call('EXISTS', lease_key(id)) == 1 then
    return redis.error_reply('TPDUPLICATE request id ' .. id .. ' already holds a lease')
  end
  if redis.call('ZSCORE', P .. ':gone', id) then
    return redis.error_reply('TPGONE request id ' .. id .. ' was given up before it was booked')
  end
  -- budgets first, and no demand counted: a tenant stopped by its budget is owed nothing
  local holds, w, flat = {}, nil, nil
  local metered = ARGV[o + A.bucket] ~= ''
  if metered then
    holds = read_holds(o)
    w = { input = tonumber(ARGV[o + A.w_in]), output = tonumber(ARGV[o + A.w_out]), cached = 0.0,
      tokens = tonumber(ARGV[o + A.tokens]), cost = tonumber(ARGV[o + A.w_cost]) }
    flat = {}
    for _, h in ipairs(holds) do
      flat[#flat + 1] = h[1]
      flat[#flat + 1] = h[2]
    end
    local over = budget_refusing(holds, w)
    if over > 0 then
      refill(e, 'o_', now)
      refill(p, 'b_', now)
      refill(p, 'pb_', now)
      local ent, pool = counters(e, ENT_COUNTERS), counters(p, POOL_COUNTERS)
      save_ent(ekey, e)
      local flags = { reserved = 0, own = 0, overcommit = 0 }
      return { 'budget', counters(flags, ADMIT_FLAGS), ent, pool, {}, budget_left(holds), over }
    end
  end
  local function new_lease()
    local l = { id = id, ent = name, tokens = tonumber(ARGV[o + A.tokens]),
      kv = tonumber(ARGV[o + A.kv]), started = tonumber(ARGV[o + A.started]),
      expires = tonumber(ARGV[o + A.expires]), pre = tonumber(ARGV[o + A.pre]),
      res = tonumber(ARGV[o + A.res]), reserved = 0, own = 0 }
    if metered then
      l.bucket, l.w_in, l.w_out, l.w_cost, l.holds = ARGV[o + A.bucket], w.input, w.output, w.cost, flat
    end
    return l
  end
  e.demand = e.demand + tonumber(ARGV[o + A.demand])
  local l = new_lease()
  local share = tonumber(ARGV[o + A.claim_share])
  local short = attempt(p, e, l, plan, now, false, {}, share)
  local overcommit, evicted = 0, {}
  if POOL_SHORTFALLS[short] then
    local victims = {}
    if #order > 0 then victims = choose_victims(p, plan, l.kv, l.tokens, order, now) end
    if #victims > 0 then
      l = new_lease()
      if attempt(p, e, l, plan, now, false, victims, share) == nil then
        for _, victim in ipairs(victims) do evicted[#evicted + 1] = lease_reply(victim[1], victim[2]) end
        short = nil
      end
    end
  end
  if short ~= nil and ARGV[o + A.may_overcommit] == '1' and POOL_SHORTFALLS[short] then
    l = new_lease()
    if attempt(p, e, l, plan, now, true, {}, share) == nil then
      overcommit = 1
      short = nil
    end
  end
  -- what a refusal's Retry-After and every answer's rate-limit headers are read from
  refill(e, 'o_', now)
  refill(p, 'b_', now)
  refill(p, 'pb_', now)
  local ent, pool = counters(e, ENT_COUNTERS), counters(p, POOL_COUNTERS)
  save_ent(ekey, e)  -- the pool is saved once, after every admission of the call
  local left = {}
  if metered and short == nil then  -- refused for room: the budgets are not the news
    budget_hold(holds, w)
    left = budget_left(holds)
  end
  local flags = { reserved = l.reserved, own = l.own, overcommit = overcommit }
  return { short or 'ok', counters(flags, ADMIT_FLAGS), ent, pool, evicted, left, 0 }
end
