# Shell helpers shared by stag's scripts (source it).

# wait_port PORT: until something listens on TCP PORT (10 s); 1 if nothing does.
wait_port() {
    for _ in $(seq 100); do
        ss -Hltn "sport = :$1" | grep -q . && return 0
        sleep 0.1
    done
    return 1
}
