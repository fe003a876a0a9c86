-- Put a request message on its priority tier's stream (inference.protocol.ENQUEUE_LUA).
-- Registers the tier and, for a new stream, creates the consumer group from id 0 so that the
-- entry added here is delivered.
-- KEYS[1] the tier's stream, KEYS[2] the tier registry; ARGV[1] str(priority), ARGV[2] the
-- consumer group, ARGV[3] the message JSON. Returns the new entry's id.
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[2], '0', 'MKSTREAM')
end
return redis.call('XADD', KEYS[1], '*', 'data', ARGV[3])
