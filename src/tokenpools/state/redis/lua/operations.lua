-- Part 5 of the pool ledger script: the other operations and the dispatch.

local function configure_pool(now)
  local p = load(P)
  if p == nil then
    p = { conc = 0.0, kv = 0.0, pre_c = 0.0, pre_k = 0.0, hold_c = 0.0, hold_k = 0.0, leases = 0,
      cl_c = 0.0, cl_k = 0.0, cl_c2 = 0.0, cl_k2 = 0.0 }
    new_bucket(p, 'b_', tonumber(ARGV[A.b_rate]), tonumber(ARGV[A.b_depth]), now)
    new_bucket(p, 'pb_', tonumber(ARGV[A.pb_rate]), tonumber(ARGV[A.pb_depth]), now)
    save(P, p, POOL_FIELDS)
    redis.call('HSET', P, 'epoch', ARGV[A.new_epoch], 'last_period', -1, 'seq', 0)
    return ARGV[A.new_epoch]
  end
  reshape(p, 'b_', tonumber(ARGV[A.b_rate]), tonumber(ARGV[A.b_depth]), now)
  reshape(p, 'pb_', tonumber(ARGV[A.pb_rate]), tonumber(ARGV[A.pb_depth]), now)
  resync_protected_bucket(p, now)
  save(P, p, POOL_FIELDS)
  return p.epoch
end

local function configure_entitlement(p, now)
  local name = ARGV[A.name]
  local key = ent_key(name)
  local e = load_ent(key)
  if e == nil then
    e = { conc = 0.0, kv = 0.0, peak_c = 0.0, peak_k = 0.0, leases = 0, hold_c = 0.0,
      hold_k = 0.0, t_acc = now, window_start = now, conc_s = 0.0, kv_s = 0.0, settled = 0.0,
      demand = 0.0, admitted = 0.0, claim_c = 0.0, claim_k = 0.0, cl_c = 0.0, cl_k = 0.0 }
    new_bucket(e, 'o_', tonumber(ARGV[A.o_rate]), tonumber(ARGV[A.o_depth]), now)
    redis.call('HSET', key, 'debt', 0, 'burst', 0, 'priority', 0, 'peak_c', 0, 'peak_k', 0)
  else
    reshape(e, 'o_', tonumber(ARGV[A.o_rate]), tonumber(ARGV[A.o_depth]), now)
  end
  e.protected = tonumber(ARGV[A.protected])
  if e.protected == 1 then
    redis.call('SADD', P .. ':prot', name)
  else
    redis.call('SREM', P .. ':prot', name)
  end
  e.base_c, e.base_k = tonumber(ARGV[A.hold_c]), tonumber(ARGV[A.hold_k])
  update_holdback(e, p)
  save_ent(key, e)
  resync_protected_bucket(p, now)
  save(P, p, POOL_FIELDS)
  return 'ok'
end

local function remove_entitlement(p, now)
  local name = ARGV[A.name]
  local key = ent_key(name)
  local e = load_ent(key)
  if e == nil then return {} end
  local ended = {}
  for _, id in ipairs(redis.call('ZRANGE', P .. ':exp', 0, -1)) do
    local l = load_lease(id)
    if l ~= nil and l.ent == name then
      finish(id, l, e, p, now, l.tokens, 0.0, nil, 'released')
      ended[#ended + 1] = lease_reply(id, l)
    end
  end
  e.base_c, e.base_k = 0.0, 0.0
  update_holdback(e, p)
  e.claim_c, e.claim_k = 0.0, 0.0
  update_claim(e, p)
  redis.call('SREM', P .. ':prot', name)
  redis.call('ZREM', P .. ':ref', name, RESERVED_ONLY .. name)
  redis.call('HDEL', P .. ':reft', name, RESERVED_ONLY .. name)
  redis.call('DEL', key)
  save(P, p, POOL_FIELDS)
  return ended
end

local function adopt(p, now)
  -- Book a lease admitted elsewhere (a replica's local fallback, or a lease Redis lost) with no
  -- checks: the request is running. Charged to the pool bucket; settling refunds the rest.
  local id, name = ARGV[A.id], ARGV[A.ent]
  if redis.call('EXISTS', lease_key(id)) == 1 then return 0 end
  local ekey = ent_key(name)
  local e = load_ent(ekey)
  if e == nil then return 0 end
  local l = { ent = name, tokens = tonumber(ARGV[A.tokens]), kv = tonumber(ARGV[A.kv]),
    started = tonumber(ARGV[A.started]), expires = tonumber(ARGV[A.expires]),
    pre = tonumber(ARGV[A.pre]), res = tonumber(ARGV[A.res]), reserved = 0, own = 0 }
  refill(p, 'b_', now)
  p.b_level = p.b_level - l.tokens
  e.admitted = e.admitted + l.tokens
  book(id, l, e, p, now)
  save_ent(ekey, e)
  save(P, p, POOL_FIELDS)
  return 1
end

local function expire(p, now)
  -- Candidates by whole microseconds; each lease's own expiry decides, and they end in the
  -- order they expire (ties by id), as in the memory store.
  local due = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':exp', '-inf', expiry_score(now))) do
    local l = load_lease(id)
    if l ~= nil and l.expires <= now then due[#due + 1] = { l.expires, id, l } end
  end
  table.sort(due, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
  local ended = {}
  for _, d in ipairs(due) do
    ended[#ended + 1] = lease_reply(d[2],
      finish_loaded(d[2], d[3], p, now, 'all', 0.0, 0.0, nil, 'expired'))
  end
  -- A replica not heard from since `stale` is gone (a process killed or restarted under a new
  -- name): its leases end now, charged in full as expiry charges them, not at their expiry.
  redis.call('HSET', P .. ':alive', OWNER, fmt(now))
  local alive = redis.call('HGETALL', P .. ':alive')
  for i = 1, #alive, 2 do
    local owner = alive[i]
    if owner ~= OWNER and tonumber(alive[i + 1]) < tonumber(ARGV[A.stale]) then
      for _, id in ipairs(redis.call('SMEMBERS', P .. ':o:' .. owner)) do
        local l = load_lease(id)
        if l ~= nil then
          ended[#ended + 1] = lease_reply(id,
            finish_loaded(id, l, p, now, 'all', 0.0, 0.0, nil, 'expired'))
        end
      end
      redis.call('DEL', P .. ':o:' .. owner)
      redis.call('HDEL', P .. ':alive', owner)
    end
  end
  if #ended > 0 then save(P, p, POOL_FIELDS) end
  redis.call('ZREMRANGEBYSCORE', P .. ':gone', '-inf', fmt(now))  -- past their lease's expiry
  return ended
end

local function take_window(now)
  local key = ent_key(ARGV[A.name])
  local e = load_ent(key)
  accumulate(e, now)
  local reply = { fmt(now - e.window_start), fmt(e.settled), fmt(e.demand), fmt(e.admitted),
    fmt(e.conc_s), fmt(e.kv_s), fmt(e.peak_c or e.conc), fmt(e.peak_k or e.kv) }
  e.window_start = now
  e.settled, e.demand, e.admitted, e.conc_s, e.kv_s = 0.0, 0.0, 0.0, 0.0, 0.0
  e.peak_c, e.peak_k = e.conc, e.kv
  save_ent(key, e)
  return reply
end

local function set_scores()
  local name = ARGV[A.name]
  local key = ent_key(name)
  redis.call('HSET', key, 'debt', ARGV[A.debt], 'burst', ARGV[A.burst],
    'priority', ARGV[A.priority], 'peak_c', ARGV[A.peak_c], 'peak_k', ARGV[A.peak_k])
  redis.call('ZADD', P .. ':low', 'XX', ARGV[A.priority], name)
  -- the claim (scores' peak_*) also lives in the record, where admissions read it
  local e = load_ent(key)
  if e ~= nil then
    local p = load(P)
    e.claim_c, e.claim_k = tonumber(ARGV[A.peak_c]), tonumber(ARGV[A.peak_k])
    update_claim(e, p)
    save_ent(key, e)
    save(P, p, POOL_FIELDS)
  end
  return 'ok'
end

local now = tonumber(ARGV[3])
if op == 'configure_pool' then return configure_pool(now) end
-- the operations that change the pool's counters read its whole hash, epoch included
local p = nil
if op == 'admit' or op == 'finish' then
  p = load(P)
  if p == nil or p.epoch ~= ARGV[2] then
    return redis.error_reply('TPEPOCH ' .. tostring(p and p.epoch))
  end
else
  local epoch = redis.call('HGET', P, 'epoch')
  if epoch ~= ARGV[2] then return redis.error_reply('TPEPOCH ' .. tostring(epoch)) end
end

if op == 'renew' then
  local l = load_lease(ARGV[A.id])
  if l == nil then return 0 end
  l.expires = tonumber(ARGV[A.expires])
  save_lease(ARGV[A.id], l)
  redis.call('ZADD', P .. ':exp', expiry_score(l.expires), ARGV[A.id])
  return 1
end
if op == 'get_lease' then
  local l = load_lease(ARGV[A.id])
  if l == nil then return nil end
  return lease_reply(ARGV[A.id], l)
end
if op == 'scores' then
  return redis.call('HMGET', ent_key(ARGV[A.name]), 'debt', 'burst', 'priority', 'peak_c',
    'peak_k')
end
if op == 'set_scores' then return set_scores() end
if op == 'take_window' then return take_window(now) end
if op == 'entitlement_counters' then
  local key = ent_key(ARGV[A.name])
  local e = load_ent(key)
  refill(e, 'o_', now)
  save_ent(key, e)
  return counters(e, ENT_COUNTERS)
end
if op == 'claim_update' then
  if tonumber(ARGV[A.period]) <= tonumber(redis.call('HGET', P, 'last_period')) then return 0 end
  redis.call('HSET', P, 'last_period', ARGV[A.period])
  return 1
end
if op == 'preemptible' then
  local out = {}
  for _, id in ipairs(redis.call('ZRANGE', P .. ':pre', 0, -1)) do
    local l = load_lease(id)
    if l ~= nil then out[#out + 1] = lease_reply(id, l) end
  end
  return out
end
if op == 'resumable' then
  -- every lease in flight is read: only when capacity is lost, never to admit
  local out = {}
  for _, id in ipairs(redis.call('ZRANGE', P .. ':exp', 0, -1)) do
    local l = load_lease(id)
    if l ~= nil and l.res == 1 then out[#out + 1] = lease_reply(id, l) end
  end
  return out
end

if op == 'admit' then
  -- Admissions, one group of arguments each, decided in order against the pool read once; an
  -- unknown entitlement or a duplicate request id is an error for its admission only.
  -- Layers (groups joined by `more`) answer as one list: each is tried only while the ones
  -- before it were refused.
  local decided, o = {}, 0
  while A.size + o <= #ARGV do
    local first = o
    local reply = admit(p, o)
    local refusal = reply.err == nil and reply[1] ~= 'ok' and reply[1]
    if ARGV[o + A.more] == '1' then
      local tried = { reply }
      while ARGV[o + A.more] == '1' do
        o = o + tonumber(ARGV[A.size + o])
        if reply.err == nil and reply[1] ~= 'ok' then
          reply = admit(p, o)
          tried[#tried + 1] = reply
        end
      end
      if reply.err ~= nil or reply[1] == 'ok' then refusal = nil end
      reply = tried
    end
    -- a refused request counts in its (first layer's) ledger bucket, as in metrics
    if refusal then ledger_refused(ARGV[first + A.bucket], refusal, tonumber(ARGV[first + A.at])) end
    decided[#decided + 1] = reply
    o = o + tonumber(ARGV[A.size + o])
  end
  save(P, p, POOL_FIELDS)
  return decided
end
if op == 'finish' then
  -- Lease ends, one group of arguments each, in the order they happened: the pool is read and
  -- written once for all of them. A lease already gone answers false (nil to the caller).
  local ended = {}
  for at = A.id, #ARGV, FINISH_GROUP do
    local id, used = ARGV[at], ARGV[at + A.used - A.id]
    -- 'all': the lease's worst case; 'taken': the same, less what taking it back gives back
    local whole = nil
    if used == 'all' or used == 'taken' then whole = used end
    local charge = nil
    if whole == nil then
      local function c(i) return tonumber(ARGV[at + i - A.id]) end
      charge = { input = c(A.c_in), output = c(A.c_out), cached = c(A.c_cached),
        tokens = tonumber(used), cost = c(A.c_cost) }
    end
    local how = 'settled'
    if whole == 'taken' then how = 'evicted' end
    local l = finish_one(id, p, tonumber(ARGV[at + A.at - A.id]), whole,
      tonumber(used) or 0.0, tonumber(ARGV[at + A.observed - A.id]), charge, how)
    local keep = tonumber(ARGV[at + A.keep - A.id])
    if l == nil and keep > 0 then
      -- an admission given up before its reply: should it still arrive, it must not book
      redis.call('ZADD', P .. ':gone', fmt(keep), id)
    end
    ended[#ended + 1] = l ~= nil and lease_reply(id, l)
  end
  save(P, p, POOL_FIELDS)
  return ended
end
if op == 'pending_usage' then return pending_usage(tonumber(ARGV[A.limit]), now) end
if op == 'ack_usage' then return ack_usage(H.owner + 1) end  -- the pairs follow the header
if op == 'recharge' then return recharge(now) end
p = load(P)
if op == 'configure_entitlement' then return configure_entitlement(p, now) end
if op == 'remove_entitlement' then return remove_entitlement(p, now) end
if op == 'adopt' then return adopt(p, now) end
if op == 'expire' then return expire(p, now) end
if op == 'pool_counters' then
  refill(p, 'b_', now)
  refill(p, 'pb_', now)
  reclaimable(p)
  save(P, p, POOL_FIELDS)
  return counters(p, POOL_COUNTERS)
end
return redis.error_reply('TPUNKNOWN operation ' .. op)
