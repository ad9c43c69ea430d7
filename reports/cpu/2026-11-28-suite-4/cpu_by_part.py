import sys,re
cpu={}
for l in open(sys.argv[1]):
    t,tot,idle=map(int,l.split()); cpu[t]=(1-idle/tot if tot else 0)*2
log=[l.rstrip('\n').split(' ',1) for l in open(sys.argv[2]) if ' ' in l]
t0=int(log[0][0])
marks=[(int(t),m) for t,m in log if m.startswith('test.sh:') and 'took' in m]
prev=t0
for t,m in marks:
    b=[cpu[x] for x in range(prev,t) if x in cpu]
    print(f"{prev-t0:5d}-{t-t0:5d}s  busy {sum(b)/max(len(b),1):.2f} cores, idle core-s {sum(2-x for x in b):6.0f}  {m}")
    prev=t
# windows
step=int(sys.argv[3]) if len(sys.argv)>3 else 30
end=max(cpu)
for a in range(t0,end,step):
    b=[cpu[x] for x in range(a,a+step) if x in cpu]
    print(f"{a-t0:5d}s {sum(b)/max(len(b),1):.2f}", end=" |")
print()
