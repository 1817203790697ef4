from shared.runtime.exits import main
from train.cli import app

# Guarded: Composer's S3 uploader starts worker processes with the `spawn` method, which re-imports the
# main module in each child; an unguarded call would start the CLI again there.
if __name__ == "__main__":
    from shared.launch.control import adopt_agent_node_rank

    adopt_agent_node_rank()  # several nodes: the rendezvous' node numbering, not the launcher's
    main(app, "python -m train")
