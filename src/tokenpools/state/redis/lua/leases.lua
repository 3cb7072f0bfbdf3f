-- Part 3 of the pool ledger script (parts are joined in order; see storage.lua).

-- leases

-- control/eviction.py refund_when_taken: what a lease taken back gives back to the pool bucket
local function refund_when_taken(l)
  if l.res == 1 then return l.tokens end
  return 0.0
end

-- What taking back the lent work in flight would give back (PoolCounters.reclaimable_tokens).
-- A pool written before it was kept has none: it is counted once from its lent leases.
local function reclaimable(p)
  if p.recl == nil then
    local total = 0.0
    for _, id in ipairs(redis.call('ZRANGE', P .. ':pre', 0, -1)) do
      local l = load_lease(id)
      if l ~= nil then total = total + refund_when_taken(l) end
    end
    p.recl = total
  end
  return p.recl
end

local function lease_reply(id, l)
  local row = { id }
  for _, f in ipairs(LEASE_ROW) do row[#row + 1] = fmt(l[f] or 0) end  -- none: booked before it
  return row
end

-- The expiry index scores a lease by whole microseconds, a lower bound of its expiry: Redis
-- keeps a small sorted set's integer scores as integers, but parses decimal ones on every
-- comparison (~20 µs per insert in a pool of a hundred leases).
local function expiry_score(t) return string.format('%d', math.floor(t * 1000000)) end

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
    p.recl = reclaimable(p) + refund_when_taken(l)
    redis.call('ZADD', P .. ':pre', redis.call('HINCRBY', P, 'seq', 1), id)
  end
  if e.protected == 1 then update_holdback(e, p) end
  -- the window's peak (a record written before peaks were kept has none)
  e.peak_c = math.max(e.peak_c or 0, e.conc)
  e.peak_k = math.max(e.peak_k or 0, e.kv)
  update_claim(e, p)
  if l.reserved == 0 then
    if redis.call('HINCRBY', P .. ':inf', l.ent, 1) == 1 then
      redis.call('ZADD', P .. ':low', fmt(e.priority), l.ent)
    end
  end
  l.owner = OWNER
  redis.call('SADD', P .. ':o:' .. OWNER, id)
  save_lease(id, l)
  redis.call('ZADD', P .. ':exp', expiry_score(l.expires), id)
end

-- End a lease: `used` tokens of its reservation are spent, the rest goes back to its buckets.
local function finish(id, l, e, p, now, used, observed, charge, how)
  redis.call('DEL', lease_key(id))
  redis.call('ZREM', P .. ':exp', id)
  if l.owner then redis.call('SREM', P .. ':o:' .. l.owner, id) end  -- none: booked before owners
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
    -- none left: exactly 0 (no rounding residue, nor a lease a script before it booked)
    if p.pre_c == 0 then p.recl = 0.0 else p.recl = reclaimable(p) - refund_when_taken(l) end
    redis.call('ZREM', P .. ':pre', id)
  end
  if e.protected == 1 then update_holdback(e, p) end
  update_claim(e, p)
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
  meter_end(l, now, charge, how)
end

-- End lease `id` (loaded: `l`), saving its entitlement; returns the lease.
-- `whole`: 'all' charges the lease's whole reservation (`used` ignored); 'taken' too, less what
-- taking it back gives back to the bucket; nil charges `used`.
local function finish_loaded(id, l, p, now, whole, used, observed, charge, how)
  local key = ent_key(l.ent)
  local e = load_ent(key)
  if whole == 'all' then used = l.tokens end
  if whole == 'taken' then used = l.tokens - refund_when_taken(l) end
  finish(id, l, e, p, now, used, observed, charge, how)
  save_ent(key, e)
  return l
end

-- End lease `id` if it exists, saving what it touched; returns the lease or nil.
local function finish_one(id, p, now, whole, used, observed, charge, how)
  local l = load_lease(id)
  if l == nil then return nil end
  return finish_loaded(id, l, p, now, whole, used, observed, charge, how)
end

-- check 5

-- A refusal of work that is not lent for want only of the room the unused protected
-- baselines hold counts against work that is not lent only, under its own key: the name after
-- the prefix RESERVED_ONLY (state/accounts.py).
local function refused(name, priority, now, reserved_only)
  local key = reserved_only and (RESERVED_ONLY .. name) or name
  redis.call('ZADD', P .. ':ref', fmt(priority), key)
  redis.call('HSET', P .. ':reft', key, fmt(now))
end

-- Whether the refusal noted under `key` counts in check 5 against `name` (`lent`: its request
-- is lent).
local function counts(key, name, lent)
  if string.sub(key, 1, 1) == RESERVED_ONLY then
    return not lent and string.sub(key, 2) ~= name
  end
  return key ~= name
end

-- The highest priority among other entitlements refused room since `since` whose refusals
-- count against `name`; stale entries found on the way are dropped.
local function top_refused(name, since, lent)
  local start = 0
  while true do
    local batch = redis.call('ZREVRANGE', P .. ':ref', start, start + 7, 'WITHSCORES')
    if #batch == 0 then return nil end
    for i = 1, #batch, 2 do
      local other = batch[i]
      if counts(other, name, lent) then
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

local function outranked(name, priority, since, lent)
  local top = top_refused(name, since, lent)
  if top == nil or top <= priority then return false end
  return priority < threshold(name)
end
